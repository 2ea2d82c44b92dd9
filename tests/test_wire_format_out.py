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
from fedddl.compression.packing import packed_size


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
