"""``ternary-entropy``: zstd-coded messages of the base-3 codes (``FDTE``)."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from fedddl.compression import (
    PayloadError,
    ResidualMemory,
    TernaryCompressor,
    TernaryEntropyCompressor,
    decode_update,
    encode_update,
    get_compressor,
    is_ternary,
    local_scales,
    make_compressor,
    max_scales,
)
from fedddl.compression.codecs import entropy as entropy_format


def _sparse_update(seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients like real ones: heavy-tailed, with dead rows (mostly zero codes)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(128, 64, generator=generator) ** 3
    weight[::3] = 0.0  # dead units
    return {
        "layer.weight": weight,
        "layer.bias": torch.randn(128, generator=generator),
        "head.weight": torch.randn(10, 128, generator=generator) ** 3,
        "head.bias": torch.randn(10, generator=generator),
    }


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_decodes_to_exactly_the_base3_values_and_is_smaller() -> None:
    update = _sparse_update()
    plain = encode_update(update, TernaryCompressor(seed=3, codec="base3"))
    coded = encode_update(update, TernaryEntropyCompressor(seed=3))
    assert coded[:4] == entropy_format.MAGIC and plain[:4] == b"FDTQ"
    assert len(coded) < 0.8 * len(plain)
    expected = decode_update(plain)
    decoded = decode_update(coded)
    assert list(decoded) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(decoded[name], tensor)
        assert decoded[name].shape == update[name].shape


def test_registered_and_ternary() -> None:
    compressor = get_compressor("ternary-entropy", seed=2, clip_sigma=None)
    assert isinstance(compressor, TernaryEntropyCompressor)
    assert compressor.name == "ternary-entropy" and compressor.codec == "base3"
    assert compressor.ternary and is_ternary("ternary-entropy")
    built = make_compressor("ternary-entropy", seed=9, clip_sigma=2.5)
    assert isinstance(built, TernaryEntropyCompressor) and built.seed == 9
    assert "TernaryEntropyCompressor(" in repr(built)


def test_scaler_sharing_and_error_feedback_work_as_with_base3() -> None:
    update = _sparse_update(1)
    results = []
    for compressor in (TernaryCompressor(seed=1, codec="base3"), TernaryEntropyCompressor(seed=1)):
        memory = ResidualMemory()
        shared = max_scales([local_scales(update, compressor, memory)])
        message = encode_update(update, compressor, memory, scales=shared, clamp=True)
        results.append((decode_update(message), memory.residuals))
    (plain, plain_residuals), (coded, coded_residuals) = results
    for name in update:
        assert torch.equal(plain[name], coded[name])
        assert torch.equal(plain_residuals[name], coded_residuals[name])


def test_out_buffers_are_written_or_left_untouched() -> None:
    update = _sparse_update(2)
    message = encode_update(update, TernaryEntropyCompressor(seed=0))
    out = {name: torch.full_like(t, 7.0) for name, t in update.items()}
    decoded = decode_update(message, out=out)
    fresh = decode_update(message)
    for name in update:
        assert decoded[name] is out[name] and torch.equal(out[name], fresh[name])
    corrupt = bytearray(message)
    corrupt[len(corrupt) // 2] ^= 0x40
    untouched = {name: torch.full_like(t, 7.0) for name, t in update.items()}
    with pytest.raises(PayloadError):
        decode_update(bytes(corrupt), out=untouched)
    assert all(bool((t == 7.0).all()) for t in untouched.values())


@pytest.mark.parametrize("numel", [1, 3, 1000, 100_000])
def test_never_larger_than_base3(numel: int) -> None:
    # codes close to uniform over {-1, 0, +1}: nothing to gain
    values = {"x": torch.rand(numel, generator=torch.Generator().manual_seed(numel)) - 0.5}
    coded = encode_update(values, TernaryEntropyCompressor(seed=0, clip_sigma=None))
    plain = encode_update(values, TernaryCompressor(seed=0, clip_sigma=None, codec="base3"))
    assert len(coded) <= len(plain)
    assert torch.equal(decode_update(coded)["x"], decode_update(plain)["x"])


def test_falls_back_to_base3_beyond_the_expansion_bound() -> None:
    # all-zero codes would expand beyond the decoder's bound: sent plain, still decodes
    zeros = {"z": torch.zeros(1 << 20)}
    message = encode_update(zeros, TernaryEntropyCompressor(seed=0))
    assert message == encode_update(zeros, TernaryCompressor(seed=0, codec="base3"))
    assert torch.equal(decode_update(message)["z"], zeros["z"])


def _coded_message() -> bytes:
    return encode_update(_sparse_update(4), TernaryEntropyCompressor(seed=0))


def test_declared_content_beyond_the_bound_is_refused_before_decompressing() -> None:
    import zstandard

    body = bytes(1 << 16)  # compresses ~1000x: above MAX_EXPANSION
    params = zstandard.ZstdCompressionParameters.from_level(
        1, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_content_size=True
    )
    frame = zstandard.ZstdCompressor(compression_params=params).compress(body)
    message = _reseal(entropy_format.MAGIC + bytes([1, 0]) + frame)
    with pytest.raises(PayloadError, match="declares"):
        decode_update(message)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m[:-4] + b"\x00" + m[-4:], "frame ends"),  # trailing byte after the frame
        (lambda m: m[:-5] + m[-4:], "frame ends|truncated|corrupt"),  # a byte cut out
        (lambda m: m[:4] + bytes([2]) + m[5:], "version"),
        (lambda m: m[:5] + bytes([1]) + m[6:], "flags"),
        (lambda m: m[:6] + bytes([m[6] | 0b1000]) + m[7:], "frame header"),  # reserved bit
        (lambda m: m[:6] + bytes([m[6] & 0b00111111]) + m[7:], "content|block|frame"),
    ],
)
def test_malformed_frames_raise_payload_error(edit: object, match: str) -> None:
    message = _coded_message()
    edited = edit(message[:-4])  # type: ignore[operator]
    with pytest.raises(PayloadError, match=match):
        decode_update(_reseal(edited))


def test_body_with_a_wrong_count_or_sizes_is_refused() -> None:
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(
        3, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_content_size=True
    )
    compress = zstandard.ZstdCompressor(compression_params=params).compress
    for body in (b"\x01", struct.pack("<I", 1 << 20) + bytes(64), struct.pack("<I", 0) + b"xx"):
        message = _reseal(entropy_format.MAGIC + bytes([1, 0]) + compress(body))
        with pytest.raises(PayloadError):
            decode_update(message)
