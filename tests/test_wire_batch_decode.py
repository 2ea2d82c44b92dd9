"""decode_small_batch: several small messages of one layout decoded at once, bit for bit
what each message's own decoding gives, or None (nothing decoded) where it does not apply."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from fedddl.compression import IdentityCompressor, PayloadError, TernaryCompressor
from fedddl.compression.backends.packing import (
    CODECS,
    invalid_code_rows,
    invalid_codes,
    packed_size,
)
from fedddl.compression.backends.unpacking import unpack_code_rows, unpack_codes_into
from fedddl.compression.codecs.wire import (
    OpenedMessage,
    decode_small_batch,
    encode_update,
    open_message,
    read_header,
)

SHAPES = {"conv": (4, 3, 3), "fc": (10, 33), "bias": (10,), "scalar": (), "empty": (0, 4)}


def _messages(count: int, codec: str = "base3", dense: set[str] | None = None,
              shapes: dict[str, tuple[int, ...]] = SHAPES) -> list[bytes]:  # fmt: skip
    generator = torch.Generator().manual_seed(count)
    found = []
    for index in range(count):
        update = {n: torch.randn(s, generator=generator) * (index + 1) for n, s in shapes.items()}
        compressor = TernaryCompressor(seed=index, codec=codec)
        found.append(bytes(encode_update(update, compressor, None, dense=dense or set())))
    return found


def _like(shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s) for n, s in shapes.items()}


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.detach().reshape(-1).view(torch.int32).tolist()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dense", [set(), {"fc", "scalar"}], ids=["ternary", "mixed"])
def test_a_batch_decodes_bit_for_bit_what_each_message_decodes(codec: str, dense: set[str]) -> None:
    payloads = _messages(5, codec, dense)
    like = _like()
    batch = decode_small_batch([open_message(p) for p in payloads], like)
    assert batch is not None and len(batch) == len(payloads)
    for payload, decoded in zip(payloads, batch, strict=True):
        own = open_message(payload).decode(out=_like())
        assert sorted(decoded) == sorted(own)
        for name, tensor in own.items():
            assert decoded[name].shape == tensor.shape and decoded[name].dtype == torch.float32
            assert _bits(decoded[name]) == _bits(tensor), name
    assert all(t.abs().sum() == 0 for t in like.values())  # like is never written


def test_dense_messages_batch_too() -> None:
    generator = torch.Generator().manual_seed(1)
    payloads = [
        bytes(encode_update({n: torch.randn(s, generator=generator) for n, s in SHAPES.items()},
                            IdentityCompressor(), None))
        for _ in range(3)
    ]  # fmt: skip
    batch = decode_small_batch([open_message(p) for p in payloads], _like())
    assert batch is not None
    for payload, decoded in zip(payloads, batch, strict=True):
        own = open_message(payload).decode()
        assert all(_bits(decoded[n]) == _bits(own[n]) for n in SHAPES)


def _with_byte(payload: bytes, name: str, value: int) -> bytes:
    """``payload`` with the first data byte of tensor ``name`` set to ``value`` (CRC redone)."""
    entries = read_header(payload)
    offset = len(payload) - 4 - sum(e.data_bytes for e in entries)
    for entry in entries:
        if entry.name == name:
            break
        offset += entry.data_bytes
    body = bytearray(payload[:-4])
    body[offset] = value
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def test_an_invalid_code_in_any_message_decodes_nothing() -> None:
    payloads = _messages(4)
    payloads[2] = _with_byte(payloads[2], "fc", 0xFF)  # a base-3 byte >= 243
    messages = [open_message(p) for p in payloads]
    assert decode_small_batch(messages, _like()) is None
    with pytest.raises(PayloadError, match="invalid base-3 byte"):
        messages[2].decode(out=_like())  # one at a time, the culprit is named
    for message in messages[:2] + messages[3:]:
        message.decode(out=_like())


def _cases() -> list[tuple[str, list[OpenedMessage], dict[str, torch.Tensor]]]:
    payloads = _messages(3)
    other = dict(SHAPES, fc=(11, 30))
    big = {"w": (300, 300)}
    return [
        ("one message", [open_message(payloads[0])], _like()),
        ("a mutable buffer", [open_message(payloads[0]), open_message(bytearray(payloads[1]))],
         _like()),
        ("another layout", [open_message(payloads[0]), open_message(_messages(1, shapes=other)[0])],
         _like()),
        ("another codec", [open_message(payloads[0]), open_message(_messages(1, "2bit")[0])],
         _like()),
        ("like lacks a tensor", [open_message(p) for p in payloads],
         {n: t for n, t in _like().items() if n != "bias"}),
        ("like in float64", [open_message(p) for p in payloads],
         {n: t.double() for n, t in _like().items()}),
        ("not small", [open_message(p) for p in _messages(2, shapes=big)], _like(big)),
    ]  # fmt: skip


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_where_the_batch_does_not_apply_it_returns_none(
    case: tuple[str, list[OpenedMessage], dict[str, torch.Tensor]],
) -> None:
    _, messages, like = case
    assert decode_small_batch(messages, like) is None


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", [1, 4, 5, 7, 33, 64])
def test_row_checks_and_unpacking_match_the_one_tensor_functions(codec: str, numel: int) -> None:
    rng = np.random.default_rng(numel)
    size = packed_size(numel, codec)
    good = np.stack([np.frombuffer(_valid_codes(rng, numel, codec), np.uint8) for _ in range(6)])
    assert not invalid_code_rows(good, numel, codec)
    scales = rng.uniform(0.1, 3.0, size=6).astype(np.float32)
    rows = np.empty((6, numel), np.float32)
    unpack_code_rows(good, numel, scales, codec, rows)
    for row, scale, values in zip(good, scales, rows, strict=True):
        own = np.empty(numel, np.float32)
        unpack_codes_into(row, numel, float(scale), codec, own)
        assert own.view(np.int32).tolist() == values.view(np.int32).tolist()
    for _ in range(40):  # random bytes: the rows' verdict is the one-tensor verdict of any row
        noisy = good.copy()
        noisy[rng.integers(6), rng.integers(size)] = rng.integers(256)
        assert invalid_code_rows(noisy, numel, codec) == any(
            invalid_codes(row, numel, codec) is not None for row in noisy
        )
    assert invalid_code_rows(good[:, :-1], numel, codec)  # too few bytes


def _valid_codes(rng: np.random.Generator, numel: int, codec: str) -> bytes:
    from fedddl.compression import pack_codes

    codes = torch.from_numpy(rng.integers(0, 3, size=numel).astype(np.uint8))
    return pack_codes(codes, codec).numpy().tobytes()
