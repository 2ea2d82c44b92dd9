"""Encoding into a reused buffer (``encode_update(into=)``): the same bytes as a new
message, the fp32 codec's finiteness check fused into the copy, nothing returned on error."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from fedddl.compression import (
    IdentityCompressor,
    TernaryCompressor,
    TernaryEntropyCompressor,
    decode_update,
    encode_update,
)
from fedddl.compression.backends import jit
from fedddl.compression.codecs.message_buffer import MessageBuffer, NonFiniteValues


@pytest.fixture(params=[False, True], ids=["numpy", "compiled"])
def jit_mode(request: pytest.FixtureRequest) -> Iterator[bool]:
    if request.param and not jit.available():
        pytest.skip("numba is not installed")
    jit.set_jit(request.param)
    yield request.param
    jit.set_jit(None)


def _update(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {  # odd-length names: the float32 data lands at unaligned offsets
        "conv.weight": torch.randn(64, 32, 3, 3, generator=generator),
        "fc": torch.randn(70_001, generator=generator),
        "b": torch.randn(7, generator=generator),
        "half": torch.randn(33, generator=generator).half(),
        "empty": torch.zeros(0),
    }


@pytest.mark.parametrize(
    "make",
    [
        IdentityCompressor,
        lambda: TernaryCompressor(seed=3),
        lambda: TernaryEntropyCompressor(seed=3),
    ],
)
def test_a_message_into_a_buffer_is_the_new_message(make: object, threads: int) -> None:
    del threads
    update = _update()
    buffer = MessageBuffer()
    expected = encode_update(update, make())  # type: ignore[operator]
    got = encode_update(update, make(), into=buffer)  # type: ignore[operator]
    assert bytes(got) == expected
    for name, tensor in decode_update(got).items():
        assert torch.equal(tensor, decode_update(expected)[name])


def test_the_buffer_is_reused_and_grows_only_when_needed() -> None:
    buffer = MessageBuffer()
    big = encode_update(_update(1), IdentityCompressor(), into=buffer)
    capacity = buffer.capacity
    assert capacity >= len(big)
    small_update = {"w": torch.arange(10.0)}
    small = encode_update(small_update, IdentityCompressor(), into=buffer)
    assert buffer.capacity == capacity  # kept, not reallocated
    assert torch.equal(decode_update(small)["w"], small_update["w"])
    again = encode_update(_update(2), IdentityCompressor(), into=buffer)
    assert bytes(again) == encode_update(_update(2), IdentityCompressor())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["fc", "b", "half"])
def test_non_finite_values_name_the_tensor_and_return_nothing(
    bad: float, where: str, jit_mode: bool
) -> None:
    del jit_mode
    update = _update()
    update[where] = update[where].clone()
    update[where].view(-1)[-1] = bad
    with pytest.raises(ValueError, match=rf"^tensor '{where}': tensor has NaN or Inf values$"):
        encode_update(update, IdentityCompressor(), into=MessageBuffer())


def test_huge_finite_float32_values_pass_the_fused_check(jit_mode: bool) -> None:
    del jit_mode
    update = {"w": torch.full((100_000,), 3.0e38)}  # their float32 sum overflows
    message = encode_update(update, IdentityCompressor(), into=MessageBuffer())
    assert torch.equal(decode_update(message)["w"], update["w"])


def test_write_checks_the_declared_size_and_names_the_bad_part() -> None:
    buffer = MessageBuffer()
    with pytest.raises(ValueError, match="declared 5"):
        buffer.write([b"abc"], 5)
    values = torch.tensor([1.0, math.nan, 2.0]).numpy().tobytes()
    with pytest.raises(NonFiniteValues) as caught:
        buffer.write([b"x", values], 1 + len(values), finite_float32={1})
    assert caught.value.part == 1
    assert bytes(buffer.write([b"x", values], 1 + len(values))) == b"x" + values  # unchecked


def test_a_sealed_write_appends_the_crc_of_the_parts() -> None:
    import zlib

    parts = [b"head", bytes(range(256)) * 5000, b"", b"tail"]  # pieces of 512 KiB and a rest
    body = b"".join(parts)
    sealed = MessageBuffer().write(parts, len(body) + 4, seal=True)
    assert bytes(sealed) == body + zlib.crc32(body).to_bytes(4, "little")


@pytest.mark.parametrize("split", [0, 1, 4095, 1 << 20])
def test_crc32_combine_is_zlibs(split: int) -> None:
    import os
    import zlib

    from fedddl.framing import crc32_combine

    data = os.urandom((1 << 20) + 12345)
    head, tail = data[:split], data[split:]
    assert crc32_combine(zlib.crc32(head), zlib.crc32(tail), len(tail)) == zlib.crc32(data)
    with pytest.raises(ValueError, match="length2"):
        crc32_combine(0, 0, -1)


def test_a_sealed_write_on_several_threads_is_the_same_message(threads: int) -> None:
    del threads
    update = {f"t{i}": torch.randn(300_000 + i) for i in range(9)}  # ~11 MB: every thread works
    message = encode_update(update, IdentityCompressor(), into=MessageBuffer())
    assert bytes(message) == encode_update(update, IdentityCompressor())


def test_the_threaded_crc_is_zlibs(threads: int) -> None:
    import os
    import zlib

    from fedddl.compression.backends.parallel import crc32_threaded

    del threads
    for size in (0, 5, (1 << 22) * 3 + 7):
        data = os.urandom(size)
        assert crc32_threaded(data) == zlib.crc32(data)
