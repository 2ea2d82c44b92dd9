"""The decoders' default limits: a message declaring too many tensors or values is refused
before anything is allocated or decompressed, naming the limit and how to raise it."""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable

import pytest
import torch

from fedddl.compression import (
    DEFAULT_MAX_TENSORS,
    DEFAULT_MAX_VALUES,
    IdentityCompressor,
    PayloadError,
    PayloadLimitError,
    TernaryCompressor,
    TernaryEntropyCompressor,
    decode_update,
    encode_update,
    limits_for,
    open_message,
    read_header,
)
from fedddl.compression.codecs import entropy
from fedddl.compression.codecs.downlink import (
    decode_broadcast,
    decode_broadcast_parts,
    encode_bundle,
    encode_reencoded,
    encode_shared_sum,
)
from fedddl.compression.codecs.wire import decode as wire_decode
from fedddl.gossip.scheduler import PeerState
from fedddl.gossip.wire import FrameKind, WireError, decode_frame, encode_frame


def _many_tensors(count: int = 1 << 16) -> bytes:
    """A valid message of ``count`` one-element fp32 tensors, built byte by byte."""
    entries = b"".join(
        struct.pack("<H", len(name)) + name + bytes([1, 0, 1]) + struct.pack("<Q", 1)
        for name in (f"t{i}".encode() for i in range(count))
    )
    data = bytes(4 * count)
    total = 18 + len(entries) + len(data) + 4
    body = b"FDTQ" + bytes([1, 0]) + struct.pack("<IQ", count, total) + entries + data
    return body + struct.pack("<I", zlib.crc32(body))


def _one_big_tensor(numel: int = 1 << 27) -> bytes:
    """A valid 2-bit message of one tensor of ``numel`` zero codes, built byte by byte."""
    entry = struct.pack("<H", 1) + b"w" + bytes([1, 1, 1]) + struct.pack("<Qf", numel, 1.0)
    data = bytes(numel // 4)
    total = 18 + len(entry) + len(data) + 4
    body = b"FDTQ" + bytes([1, 0]) + struct.pack("<IQ", 1, total) + entry + data
    return body + struct.pack("<I", zlib.crc32(body))


def _entropy_coded_big_tensor(numel: int = 1 << 27) -> bytes:
    """A valid ``FDTE`` message of one 2-bit tensor of ``numel`` codes, within the 64x
    expansion bound (random codes first, zeros after), built from its body."""
    import numpy as np
    import zstandard

    entry = struct.pack("<H", 1) + b"w" + bytes([1, 1, 1]) + struct.pack("<Qf", numel, 1.0)
    rng = np.random.default_rng(0)
    trits = rng.integers(0, 3, size=(1 << 23, 4), dtype=np.uint8)  # 2 MiB of valid codes
    noisy = (trits << np.array([0, 2, 4, 6], dtype=np.uint8)).sum(axis=1).astype(np.uint8)
    body = struct.pack("<I", 1) + entry + noisy.tobytes() + bytes(numel // 4 - len(noisy))
    params = zstandard.ZstdCompressionParameters.from_level(
        1, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_content_size=True,
        write_checksum=False, write_dict_id=False,
    )
    frame = zstandard.ZstdCompressor(compression_params=params).compress(body)
    message = entropy.MAGIC + bytes([entropy.VERSION, 0]) + frame
    message += struct.pack("<I", zlib.crc32(message))
    assert len(body) <= entropy.MAX_EXPANSION * len(message)
    return message


@pytest.fixture(scope="module")
def many() -> bytes:
    return _many_tensors()


@pytest.fixture(scope="module")
def big() -> bytes:
    return _one_big_tensor()


def _refused_cheaply(decode: Callable[[], object], match: str) -> None:
    """``decode`` raises PayloadError matching ``match`` in < 50 ms, allocating < 1 MiB."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(PayloadLimitError, match=match):
            decode()
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.05, f"refusal took {elapsed * 1e3:.1f} ms"  # before the CRC
    assert peak < 1 << 20, f"refusal allocated {peak} bytes"


@pytest.mark.parametrize("decoder", [decode_update, read_header, open_message])
def test_a_message_of_65536_tensors_is_refused_by_default(
    many: bytes, decoder: Callable[..., object]
) -> None:
    _refused_cheaply(
        lambda: decoder(many), rf"65536 tensors, at most {DEFAULT_MAX_TENSORS} .*max_tensors="
    )


@pytest.mark.parametrize("decoder", [decode_update, read_header, open_message])
def test_a_valid_tensor_of_2_27_values_is_refused_by_default(
    big: bytes, decoder: Callable[..., object]
) -> None:
    _refused_cheaply(
        lambda: decoder(big), rf"{1 << 27} values .*at most {DEFAULT_MAX_VALUES} .*max_values="
    )


def test_an_entropy_coded_tensor_of_2_27_values_is_refused_before_decompressing() -> None:
    message = _entropy_coded_big_tensor()
    (entry,) = read_header(message, max_values=1 << 27)  # only the limit refuses it
    assert entry.numel == 1 << 27
    _refused_cheaply(lambda: decode_update(message), rf"{1 << 27} values .*max_values=")


def test_the_limits_are_checked_before_the_crc(big: bytes) -> None:
    damaged = big[:-1] + bytes([big[-1] ^ 0xFF])
    with pytest.raises(PayloadLimitError, match="max_values="):
        decode_update(damaged)
    with pytest.raises(PayloadError, match="CRC"):
        decode_update(damaged, max_values=1 << 27)


def test_the_refused_big_tensor_is_well_formed(big: bytes) -> None:
    (entry,) = read_header(big, max_values=1 << 27)  # only the limit refused it
    assert entry.numel == 1 << 27 and entry.codec == "2bit"


def test_the_defaults_fit_resnet18_and_raised_limits_accept_more() -> None:
    assert DEFAULT_MAX_TENSORS >= 62 and DEFAULT_MAX_VALUES >= 11_200_000
    update = {f"t{i}": torch.randn(3, 5) for i in range(10)}
    message = encode_update(update, TernaryCompressor(seed=0))
    with pytest.raises(PayloadError, match="max_tensors=9"):
        decode_update(message, max_tensors=9)
    with pytest.raises(PayloadError, match="max_values=149"):
        decode_update(message, max_values=149)
    assert limits_for(update) == {"max_tensors": 10, "max_values": 150}
    assert decode_update(message, **limits_for(update)).keys() == update.keys()


def test_out_raises_the_defaults_to_its_own_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire_decode, "DEFAULT_MAX_VALUES", 100)
    update = {"w": torch.randn(200)}
    message = encode_update(update, IdentityCompressor())
    with pytest.raises(PayloadError, match="max_values=100"):
        decode_update(message)
    out = {"w": torch.zeros(200)}
    decode_update(message, out=out)
    assert torch.equal(out["w"], update["w"])


def test_an_entropy_coded_body_over_max_bytes_is_refused_before_decompressing() -> None:
    update = {"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) ** 3}
    update["w"][::3] = 0.0  # codes with many zeros: zstd wins
    message = encode_update(update, TernaryEntropyCompressor(seed=0))
    assert message[:4] == entropy.MAGIC
    body = entropy.open_entropy_coded(memoryview(message))
    with pytest.raises(PayloadError, match=f"max_bytes={len(body) - 1}"):
        entropy.open_entropy_coded(memoryview(message), len(body) - 1)
    with pytest.raises(PayloadError, match="max_bytes="):
        decode_update(message, max_bytes=len(message) + 8)  # the body is larger


def test_broadcast_decoders_apply_the_limits() -> None:
    update = {f"t{i}": torch.ones(4) for i in range(5)}
    reencoded = encode_reencoded(update, IdentityCompressor(), None)
    shared = encode_shared_sum(
        {n: torch.ones(4, dtype=torch.int64) for n in update},
        dict.fromkeys(update, 0.5),
        {n: (4,) for n in update},
        2,
    )
    for data in (reencoded, shared, encode_bundle(reencoded, dense={"d": torch.ones(3)})):
        with pytest.raises(PayloadError, match="max_tensors=4"):
            decode_broadcast(data, max_tensors=4)
        with pytest.raises(PayloadError, match="max_values=19"):
            decode_broadcast(data, max_values=19)
        assert set(decode_broadcast(data, max_tensors=5, max_values=20)) >= set(update)
    stats = encode_bundle(reencoded, statistics={"bn.running_mean": torch.zeros(30)})
    with pytest.raises(PayloadError, match="max_values=29"):
        decode_broadcast_parts(stats, max_values=29)


def test_gossip_frames_over_the_limits_are_refused_before_any_tensor_is_built() -> None:
    state = PeerState(node_id=1, enabled=True, model_version=0)
    empty = {f"t{i}": torch.zeros(0) for i in range(DEFAULT_MAX_TENSORS + 1)}
    frame = encode_frame(FrameKind.MODEL, 1, state, empty)
    with pytest.raises(WireError, match="max_tensors="):
        decode_frame(frame)
    assert len(decode_frame(frame, max_tensors=len(empty)).tensors) == len(empty)
    small = encode_frame(FrameKind.MODEL, 1, state, {"w": torch.ones(10)})
    with pytest.raises(WireError, match="max_values=9"):
        decode_frame(small, max_values=9)
    with pytest.raises(WireError, match="max_header_bytes="):
        decode_frame(small, max_header_bytes=10)
