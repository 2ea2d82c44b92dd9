"""decode_update(data, out=...): decoding in place into caller-owned tensors."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from fedddl.compression import (
    IdentityCompressor,
    PayloadError,
    TernaryCompressor,
    decode_update,
    encode_update,
)
from fedddl.compression.backends.packing import packed_size


def _update() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "conv.weight": torch.randn(4, 3, 3, 3, generator=generator),  # 108 values
        "fc.weight": torch.randn(10, 33, generator=generator),  # 330: partial last byte
        "fc.bias": torch.randn(10, generator=generator),
        "scalar": torch.tensor(-0.5),
    }


def _buffers(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, float("nan")) for name, t in like.items()}


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_decoding_into_buffers_equals_a_fresh_decode(codec: str) -> None:
    update = _update()
    data = encode_update(update, TernaryCompressor(seed=1, min_numel=11, codec=codec))
    buffers = _buffers(update)
    decoded = decode_update(data, out=buffers)
    assert list(decoded) == list(update)
    fresh = decode_update(data)
    for name, tensor in decoded.items():
        assert tensor is buffers[name]
        torch.testing.assert_close(tensor, fresh[name], rtol=0, atol=0)
    # the dense fp32 entries (fc.bias, scalar, below min_numel) arrive bit-exact
    torch.testing.assert_close(buffers["fc.bias"], update["fc.bias"], rtol=0, atol=0)


def test_other_dtypes_non_contiguous_and_parameter_targets_are_cast_and_written() -> None:
    update = _update()
    data = encode_update(update, TernaryCompressor(seed=2))
    fresh = decode_update(data)
    parameter = torch.nn.Parameter(torch.zeros(10, 33))
    out = {
        "conv.weight": torch.zeros(4, 3, 3, 3, dtype=torch.float64),
        "fc.weight": parameter,
        "fc.bias": torch.zeros(20)[::2],  # not contiguous
        "scalar": torch.zeros((), dtype=torch.bfloat16),
    }
    decode_update(data, out=out)
    assert out["conv.weight"].dtype == torch.float64
    torch.testing.assert_close(out["conv.weight"], fresh["conv.weight"].double(), rtol=0, atol=0)
    torch.testing.assert_close(parameter.detach(), fresh["fc.weight"], rtol=0, atol=0)
    torch.testing.assert_close(out["fc.bias"], fresh["fc.bias"], rtol=0, atol=0)
    assert float(out["scalar"]) == float(fresh["scalar"].bfloat16())


def test_identity_messages_decode_into_buffers_bit_exactly() -> None:
    update = _update()
    buffers = _buffers(update)
    decode_update(encode_update(update, IdentityCompressor()), out=buffers)
    for name, tensor in update.items():
        torch.testing.assert_close(buffers[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda out: out.pop("fc.bias"), r"not in out \['fc.bias'\]"),
        (lambda out: out.update(extra=torch.zeros(1)), r"not in the message \['extra'\]"),
        (lambda out: out.update({"fc.weight": torch.zeros(33, 10)}), "shape"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_a_message_that_does_not_fit_out_is_rejected_and_nothing_is_written(
    change: object, message: str
) -> None:
    update = _update()
    data = encode_update(update, TernaryCompressor(seed=0))
    out = {name: torch.zeros_like(t) for name, t in update.items()}
    change(out)  # type: ignore[operator]
    with pytest.raises(PayloadError, match=message):
        decode_update(data, out=out)
    for tensor in out.values():
        assert not bool(tensor.any())


def test_an_invalid_code_in_a_later_tensor_leaves_every_buffer_untouched() -> None:
    update = _update()  # every entry ternary 2-bit; data sections in entry order, then the CRC
    data = bytearray(encode_update(update, TernaryCompressor(seed=0)))
    after = sum(packed_size(update[name].numel(), "2bit") for name in ("fc.bias", "scalar"))
    fc_weight_end = len(data) - 4 - after
    data[fc_weight_end - 1] = 0xFF  # four 0b11 codes in the last byte of fc.weight
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    out = {name: torch.zeros_like(t) for name, t in update.items()}
    with pytest.raises(PayloadError, match=r"'fc\.weight': invalid ternary code"):
        decode_update(bytes(data), out=out)
    for tensor in out.values():  # conv.weight, before fc.weight, was not written either
        assert not bool(tensor.any())


def test_out_must_be_a_mapping_of_float_tensors() -> None:
    data = encode_update({"w": torch.ones(8)}, TernaryCompressor())
    with pytest.raises(TypeError, match="mapping"):
        decode_update(data, out=[torch.zeros(8)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        decode_update(data, out={"w": torch.zeros(8, dtype=torch.int32)})


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_small_messages_decode_to_the_same_bits_as_the_batched_path(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedddl.compression.backends import unpacking

    update = _update()
    data = encode_update(update, TernaryCompressor(seed=4, min_numel=11, codec=codec))
    small_out = decode_update(data, out=_buffers(update))
    small_new = decode_update(data)
    monkeypatch.setattr(unpacking, "_SMALL_NUMEL", 0)  # every message takes the batched path
    batched_out = decode_update(data, out=_buffers(update))
    batched_new = decode_update(data)
    for name in update:
        torch.testing.assert_close(small_out[name], batched_out[name], rtol=0, atol=0)
        torch.testing.assert_close(small_new[name], batched_new[name], rtol=0, atol=0)
        torch.testing.assert_close(small_new[name], small_out[name], rtol=0, atol=0)


def test_an_opened_message_decodes_without_reading_its_header_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedddl.compression import open_message
    from fedddl.compression.codecs.wire import header as wire

    update = _update()
    data = encode_update(update, TernaryCompressor(seed=5, min_numel=11))
    reads = []
    parse = wire._parse_entries
    monkeypatch.setattr(wire, "_parse_entries", lambda *a: reads.append(1) or parse(*a))
    message = open_message(data, dense_peaks=True)
    assert [e.name for e in message.entries] == list(update)
    decoded = message.decode(out=_buffers(update))
    assert len(reads) == 1  # bytes cannot change: the header read at opening serves
    reference = decode_update(data)
    for name in update:
        torch.testing.assert_close(decoded[name], reference[name], rtol=0, atol=0)


def test_a_mutable_message_is_checked_again_and_refused_if_its_header_changed() -> None:
    from fedddl.compression import open_message

    update = {"w": torch.linspace(-1, 1, 40)}
    data = bytearray(encode_update(update, TernaryCompressor(seed=6)))
    message = open_message(data)
    scale_at = data.index(struct.pack("<f", message.entries[0].scale))
    data[scale_at : scale_at + 4] = struct.pack("<f", 1e6)  # a larger scale than screened
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    out = {"w": torch.zeros(40)}
    with pytest.raises(PayloadError, match="header changed after it was read"):
        message.decode(out=out)
    data[-1] ^= 1  # and a corrupted one fails its checksum
    with pytest.raises(PayloadError, match="CRC"):
        message.decode(out=out)
    assert not bool(out["w"].any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dense_peaks_are_the_largest_magnitude_and_refuse_non_finite_values(
    dtype: torch.dtype,
) -> None:
    from fedddl.compression import read_header

    values = torch.tensor([0.25, -3.5, 2.0, -0.0], dtype=dtype)
    (entry,) = read_header(encode_update({"b": values}, IdentityCompressor()), dense_peaks=True)
    assert entry.peak == 3.5
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = values.clone()
        poisoned[2] = bad
        message = bytearray(encode_update({"b": values}, IdentityCompressor()))
        raw = poisoned.view(torch.uint8).numpy().tobytes()
        start = len(message) - 4 - len(raw)
        message[start:-4] = raw
        message[-4:] = struct.pack("<I", zlib.crc32(bytes(message[:-4])))
        with pytest.raises(PayloadError, match="non-finite"):
            read_header(bytes(message), dense_peaks=True)
