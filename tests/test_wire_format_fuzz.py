"""Fuzzing decode_update: any exception other than PayloadError is a bug."""

from __future__ import annotations

import struct
import zlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedddl.compression import (
    PayloadError,
    TernaryCompressor,
    TernaryEntropyCompressor,
    decode_update,
    encode_update,
)

_MESSAGE = encode_update(
    {
        "w": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)),
        "b": torch.randn(3),
        "s": torch.tensor(1.5).double(),
    },
    TernaryCompressor(seed=0, min_numel=4),
)
_SETTINGS = settings(max_examples=300, deadline=None)


def _decode_or_payload_error(data: bytes) -> dict[str, torch.Tensor] | None:
    try:
        return decode_update(data)
    except PayloadError:
        return None


def _reseal(body: bytes) -> bytes:
    if len(body) < 18:
        return body
    body = body[:10] + struct.pack("<Q", len(body) + 4) + body[18:]
    return body + struct.pack("<I", zlib.crc32(body))


@_SETTINGS
@given(st.integers(min_value=0, max_value=len(_MESSAGE) - 1))
def test_truncations(length: int) -> None:
    assert _decode_or_payload_error(_MESSAGE[:length]) is None


@_SETTINGS
@given(st.lists(st.tuples(st.integers(0, len(_MESSAGE) - 1), st.integers(1, 255)), min_size=1))
def test_byte_flips_are_caught_by_the_crc(flips: list[tuple[int, int]]) -> None:
    data = bytearray(_MESSAGE)
    for position, mask in flips:
        data[position] ^= mask
    result = _decode_or_payload_error(bytes(data))
    assert result is None or bytes(data) == _MESSAGE


@_SETTINGS
@given(st.lists(st.tuples(st.integers(18, len(_MESSAGE) - 5), st.integers(0, 255)), min_size=1))
def test_resealed_corruptions_raise_only_payload_error(edits: list[tuple[int, int]]) -> None:
    # valid CRC and length: the header and code validation must still hold
    body = bytearray(_MESSAGE[:-4])
    for position, value in edits:
        body[position] = value
    result = _decode_or_payload_error(_reseal(bytes(body)))
    if result is not None:
        for tensor in result.values():
            assert tensor.numel() <= len(_MESSAGE) * 5


@_SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    assert _decode_or_payload_error(data) is None


def test_an_empty_shape_whose_strides_overflow_is_a_payload_error() -> None:
    # found by the fuzzer below: 0 values, but the other dimensions' product overflows int64
    dims = [0, 233, 109206, 362_482_718_091]
    entry = struct.pack("<H", 1) + b"x" + bytes([1, 1, len(dims)])
    entry += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<f", 1.0)
    body = b"FDTQ" + bytes([1, 0]) + struct.pack("<IQ", 1, 0) + entry
    assert _decode_or_payload_error(_reseal(body)) is None


@_SETTINGS
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=4),
    st.integers(0, 4),
    st.integers(0, 5),
    st.binary(max_size=16),
)
def test_random_shapes_raise_only_payload_error(
    dims: list[int], kind: int, dtype: int, payload: bytes
) -> None:
    entry = struct.pack("<H", 1) + b"x" + bytes([dtype, kind, len(dims)])
    entry += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<f", 1.0)
    body = b"FDTQ" + bytes([1, 0]) + struct.pack("<IQ", 1, 0) + entry + payload
    _decode_or_payload_error(_reseal(body))


@_SETTINGS
@given(st.binary(max_size=120))
def test_random_bodies_behind_a_valid_prefix(tail: bytes) -> None:
    body = b"FDTQ" + bytes([1, 0]) + struct.pack("<IQ", tail[0] if tail else 0, 0) + tail
    _decode_or_payload_error(_reseal(body))


# ---------------------------------------------------------------- entropy-coded (FDTE)
_CODED = encode_update(
    {
        "w": torch.randn(40, 30, generator=torch.Generator().manual_seed(1)) ** 3,
        "b": torch.randn(3),
        "s": torch.tensor(1.5).double(),
    },
    TernaryEntropyCompressor(seed=0, min_numel=4),
)


def _reseal_coded(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_the_fuzzed_message_is_entropy_coded() -> None:
    assert _CODED[:4] == b"FDTE"


@_SETTINGS
@given(st.integers(min_value=0, max_value=len(_CODED) - 1))
def test_coded_truncations(length: int) -> None:
    assert _decode_or_payload_error(_CODED[:length]) is None


@_SETTINGS
@given(st.lists(st.tuples(st.integers(0, len(_CODED) - 1), st.integers(1, 255)), min_size=1))
def test_coded_byte_flips_are_caught_by_the_crc(flips: list[tuple[int, int]]) -> None:
    data = bytearray(_CODED)
    for position, mask in flips:
        data[position] ^= mask
    result = _decode_or_payload_error(bytes(data))
    assert result is None or bytes(data) == _CODED


@_SETTINGS
@given(st.lists(st.tuples(st.integers(6, len(_CODED) - 5), st.integers(0, 255)), min_size=1))
def test_coded_resealed_corruptions_raise_only_payload_error(edits: list[tuple[int, int]]) -> None:
    # a valid CRC: the zstd frame checks, the bounds and the body's validation must hold
    body = bytearray(_CODED[:-4])
    for position, value in edits:
        body[position] = value
    result = _decode_or_payload_error(_reseal_coded(bytes(body)))
    if result is not None:
        for tensor in result.values():
            assert tensor.numel() <= len(_CODED) * 64 * 5


@_SETTINGS
@given(st.binary(max_size=300))
def test_random_frames_behind_a_valid_prefix(frame: bytes) -> None:
    _decode_or_payload_error(_reseal_coded(b"FDTE" + bytes([1, 0]) + frame))
