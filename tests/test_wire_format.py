"""encode_update / decode_update: layout, round trips, size, and every rejection."""

from __future__ import annotations

import math
import struct
import zlib

import pytest
import torch

from fedddl.compression import (
    BUCKETS_VERSION,
    FORMAT_VERSION,
    MAGIC,
    IdentityCompressor,
    PayloadError,
    TernaryCompressor,
    decode_update,
    encode_update,
)
from tests.support.reference import python_pack


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(7, 13, generator=generator),  # 91: not a multiple of 4 or 5
        "layer.bias": torch.randn(3, generator=generator),
        "scalar": torch.tensor(0.75),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(2, 3, 5, generator=generator).half(),
        "brain": torch.randn(11, generator=generator).bfloat16(),
        "double": torch.randn(6, generator=generator).double(),
        "ünïcode/名前": torch.randn(1, 1, 1, 2, generator=generator),
    }


def _reseal(body: bytes) -> bytes:
    """Give ``body`` (a message without its CRC) a valid length field and CRC."""
    body = body[:10] + struct.pack("<Q", len(body) + 4) + body[18:]
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize(
    "compressor",
    [TernaryCompressor(seed=1), TernaryCompressor(codec="base3"), IdentityCompressor()],
    ids=["ternary", "base3", "identity"],
)
def test_round_trip_names_shapes_dtypes(compressor: object) -> None:
    tensors = _tensors()
    assert isinstance(compressor, (TernaryCompressor, IdentityCompressor))
    decoded = decode_update(encode_update(tensors, compressor))
    assert list(decoded) == list(tensors)
    for name, tensor in tensors.items():
        assert decoded[name].shape == tensor.shape, name
        assert decoded[name].dtype == tensor.dtype, name
        assert decoded[name].is_contiguous()


def test_decoded_ternary_values_equal_the_compressors_view() -> None:
    tensors = _tensors()
    data = encode_update(tensors, TernaryCompressor(seed=3))
    again = TernaryCompressor(seed=3)
    decoded = decode_update(data)
    for name, tensor in tensors.items():
        expected = again.decompress(*again.compress(tensor))
        torch.testing.assert_close(decoded[name], expected, rtol=0, atol=0)


def test_byte_layout_of_a_single_tensor() -> None:
    g = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0, 0.0])
    compressor = TernaryCompressor(clip_sigma=None, deterministic=True)
    data = encode_update({"ab": g.view(2, 3)}, compressor)
    expected_header = (
        MAGIC
        + bytes([FORMAT_VERSION, 0])
        + struct.pack("<IQ", 1, len(data))
        + struct.pack("<H", 2)
        + b"ab"
        + bytes([1, 1, 2])
        + struct.pack("<QQf", 2, 3, 1.0)
    )
    codes = python_pack([1, -1, 0, 1, -1, 0])
    assert data[:-4] == expected_header + codes
    assert data[-4:] == struct.pack("<I", zlib.crc32(data[:-4]))
    assert codes == bytes([0b01_00_10_01, 0b00_10])


def test_million_parameter_update_is_16x_smaller() -> None:
    g = torch.randn(1000, 1000)
    data = encode_update({"fc.weight": g}, TernaryCompressor())
    fp32_bytes = 4 * 1_000_000
    assert fp32_bytes / len(data) >= 15.9
    base3 = encode_update({"fc.weight": g}, TernaryCompressor(codec="base3"))
    assert fp32_bytes / len(base3) >= 19.9
    dense = encode_update({"fc.weight": g}, IdentityCompressor())
    assert len(dense) > fp32_bytes


def test_shared_scales_are_used() -> None:
    tensors = {"a": torch.randn(50), "b": torch.randn(50)}
    compressor = TernaryCompressor(clip_sigma=None)
    data = encode_update(tensors, compressor, scales={"a": 10.0})
    decoded = decode_update(data)
    assert set(decoded["a"].abs().flatten().tolist()) <= {0.0, 10.0}
    with pytest.raises(ValueError, match="unknown tensors"):
        encode_update(tensors, compressor, scales={"zz": 1.0})


def test_encode_errors_name_the_tensor() -> None:
    bad = torch.randn(5)
    bad[1] = math.inf
    with pytest.raises(ValueError, match=r"'grad\.x'.*NaN or Inf"):
        encode_update({"ok": torch.randn(3), "grad.x": bad}, TernaryCompressor())
    with pytest.raises(TypeError, match="'ints'"):
        encode_update({"ints": torch.arange(3)}, TernaryCompressor())
    with pytest.raises(ValueError, match="'bad-\\\\udc80'"):
        encode_update({"bad-\udc80": torch.randn(3)}, TernaryCompressor())  # not UTF-8 encodable
    with pytest.raises(ValueError, match="longer than"):
        encode_update({"n" * 2000: torch.randn(3)}, TernaryCompressor())


# ----------------------------------------------------------------- rejections


def _message() -> bytes:
    return encode_update({"w": torch.randn(9), "b": torch.randn(2)}, TernaryCompressor(seed=0))


def test_rejects_truncation_everywhere() -> None:
    data = _message()
    for length in range(len(data)):
        with pytest.raises(PayloadError, match=r"truncated|shorter"):
            decode_update(data[:length])


def test_rejects_trailing_bytes() -> None:
    with pytest.raises(PayloadError, match="trailing"):
        decode_update(_message() + b"\x00")


def test_rejects_wrong_magic_and_version() -> None:
    data = _message()
    with pytest.raises(PayloadError, match="magic"):
        decode_update(b"XXXX" + data[4:])
    with pytest.raises(PayloadError, match="version"):
        decode_update(data[:4] + bytes([BUCKETS_VERSION + 1]) + data[5:])


def test_rejects_crc_mismatch() -> None:
    data = bytearray(_message())
    data[-6] ^= 0x10
    with pytest.raises(PayloadError, match="CRC"):
        decode_update(bytes(data))


def _single(kind: int, dtype: int, shape: tuple[int, ...], scale: float, payload: bytes) -> bytes:
    entry = struct.pack("<H", 1) + b"x" + bytes([dtype, kind, len(shape)])
    entry += struct.pack(f"<{len(shape)}Q", *shape)
    if kind != 0:
        entry += struct.pack("<f", scale)
    prefix = MAGIC + bytes([FORMAT_VERSION, 0]) + struct.pack("<IQ", 1, 0)
    return _reseal(prefix + entry + payload)


def test_hand_built_message_decodes() -> None:
    out = decode_update(_single(1, 1, (5,), 2.0, python_pack([1, 0, -1, 0, 1])))
    torch.testing.assert_close(out["x"], torch.tensor([2.0, 0.0, -2.0, 0.0, 2.0]))


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        (_single(1, 1, (4,), 1.0, bytes([0b11])), "0b11"),
        (_single(1, 1, (3,), 1.0, bytes([0b01_00_00_00])), "padding"),
        (_single(2, 1, (5,), 1.0, bytes([250])), "base-3"),
        (_single(1, 1, (8,), 1.0, bytes([0])), "data bytes"),
        (_single(1, 1, (4,), 1.0, bytes([0, 0])), "data bytes"),
        (_single(1, 1, (2**40, 2**20), 1.0, bytes([0])), "max_values"),  # the default limit
        (_single(0, 1, (3,), 0.0, bytes(8)), "data bytes"),
        (_single(1, 1, (4,), math.nan, bytes([0])), "non-finite scale"),
        (_single(1, 1, (4,), math.inf, bytes([0])), "non-finite scale"),
        (_single(1, 1, (4,), -1.0, bytes([0])), "negative scale"),
        (_single(1, 9, (4,), 1.0, bytes([0])), "unknown dtype"),
        (_single(7, 1, (4,), 1.0, bytes([0])), "unknown kind"),
        (_single(1, 1, (1,) * 17, 1.0, bytes([0])), "dimensions"),
        (_single(1, 1, (0, 2**63), 1.0, b""), "exceeds"),
        (_single(0, 1, (2**49, 0), 0.0, b""), "exceeds"),
    ],
)
def test_rejects_bad_entries(message: bytes, problem: str) -> None:
    with pytest.raises(PayloadError, match=problem):
        decode_update(message)


def test_rejects_repeated_names_and_bad_utf8() -> None:
    entry = struct.pack("<H", 1) + b"x" + bytes([1, 1, 1]) + struct.pack("<Qf", 4, 1.0)
    prefix = MAGIC + bytes([FORMAT_VERSION, 0]) + struct.pack("<IQ", 2, 0)
    with pytest.raises(PayloadError, match="repeated"):
        decode_update(_reseal(prefix + entry + entry + bytes(2)))
    bad_name = struct.pack("<H", 1) + b"\xff" + bytes([1, 1, 1]) + struct.pack("<Qf", 4, 1.0)
    prefix = MAGIC + bytes([FORMAT_VERSION, 0]) + struct.pack("<IQ", 1, 0)
    with pytest.raises(PayloadError, match="UTF-8"):
        decode_update(_reseal(prefix + bad_name + bytes(1)))


def test_rejects_implausible_counts_and_flags() -> None:
    prefix = MAGIC + bytes([FORMAT_VERSION, 0]) + struct.pack("<IQ", 2**31, 0)
    with pytest.raises(PayloadError, match="count"):
        decode_update(_reseal(prefix))
    prefix = MAGIC + bytes([FORMAT_VERSION, 1]) + struct.pack("<IQ", 0, 0)
    with pytest.raises(PayloadError, match="flags"):
        decode_update(_reseal(prefix))
    with pytest.raises(PayloadError, match="bytes"):
        decode_update("text")  # type: ignore[arg-type]


def test_empty_update_round_trips() -> None:
    assert decode_update(encode_update({}, TernaryCompressor())) == {}


def test_decode_limits_and_small_dense_tensors_are_independent_copies() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.tensor([1.5], dtype=torch.float64), "c": torch.zeros(0, 4)}
    message = encode_update(tensors, IdentityCompressor())
    with pytest.raises(PayloadError, match="exceeds the limit"):
        decode_update(message, max_bytes=len(message) - 1)
    with pytest.raises(PayloadError, match="at most 2 expected"):
        decode_update(message, max_tensors=2)
    decoded = decode_update(message, max_bytes=len(message), max_tensors=3)
    for name, tensor in tensors.items():
        assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor)
    decoded["a"].add_(1)  # writable, aliasing neither the message nor the other tensors
    assert torch.equal(decode_update(message)["a"], tensors["a"])
    assert torch.equal(decoded["b"], tensors["b"])
