"""The chunked, multi-threaded kernels against unchunked, single-call numpy references.

The other compression tests use tensors smaller than one chunk and one torch
thread (the autouse fixture); these use several chunks and several threads, so
every range boundary, chunk boundary and the partial last byte are exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedddl.compression import TernaryCompressor, TernaryPayload, pack_codes, unpack_codes
from fedddl.compression.backends.packing import packed_size
from fedddl.compression.backends.ternarize import CHUNK, PROBABILITY_BITS
from fedddl.compression.backends.unpacking import unpack_codes_batch, unpack_codes_new

# three ternariser chunks and a partial byte for both codecs
_NUMEL = 3 * CHUNK + 7


def _reference_pack(codes: np.ndarray, codec: str) -> np.ndarray:
    """Weighted sums over groups: the layout written the obvious way."""
    per, weights = (4, [1, 4, 16, 64]) if codec == "2bit" else (5, [1, 3, 9, 27, 81])
    padded = np.zeros(packed_size(codes.size, codec) * per, dtype=np.int64)
    padded[: codes.size] = codes
    return (padded.reshape(-1, per) * np.array(weights)).sum(axis=1).astype(np.uint8)


def _reference_signs(values: np.ndarray, scale: float, seed: int) -> np.ndarray:
    """TernGrad's rule of :mod:`fedddl.compression.backends.ternarize`, in one unchunked pass."""
    rand = np.random.PCG64DXSM(seed).random_raw(-(-values.size // 4)).view(np.uint16)
    factor = np.float32(float(1 << PROBABILITY_BITS) / scale)
    level = (np.abs(values) * factor - np.float32(0.5)).astype(np.float32)
    fire = rand[: values.size] < level
    return np.where(fire, np.where(np.signbit(values), 2, 1), 0).astype(np.uint8)


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_stochastic_codes_match_the_unchunked_reference(threads: int, codec: str) -> None:
    values = torch.randn(_NUMEL, generator=torch.Generator().manual_seed(threads))
    payload, _ = TernaryCompressor(seed=5, clip_sigma=None, codec=codec).compress(values)
    assert isinstance(payload, TernaryPayload)
    expected = _reference_pack(_reference_signs(values.numpy(), payload.scale, 5), codec)
    np.testing.assert_array_equal(payload.codes.numpy(), expected)


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_pack_and_unpack_match_the_reference(threads: int, codec: str) -> None:
    numel = 4 * 5 * (1 << 16) + 3  # several unpack chunks
    rng = np.random.default_rng(threads)
    codes = rng.integers(0, 3, numel).astype(np.uint8)
    packed = pack_codes(torch.from_numpy(codes), codec)
    np.testing.assert_array_equal(packed.numpy(), _reference_pack(codes, codec))
    decoded = unpack_codes(packed, numel, 0.25, codec)
    expected = np.array([0.0, 0.25, -0.25], dtype=np.float32)[codes]
    np.testing.assert_array_equal(decoded.numpy(), expected)


def test_unpack_into_a_buffer_equals_a_fresh_unpack(threads: int) -> None:
    codes = np.random.default_rng(0).integers(0, 3, _NUMEL).astype(np.uint8)
    packed = pack_codes(torch.from_numpy(codes), "base3")
    buffer = torch.full((_NUMEL,), float("nan"))
    result = unpack_codes(packed, _NUMEL, 1.5, "base3", out=buffer)
    assert result is buffer
    torch.testing.assert_close(buffer, unpack_codes(packed, _NUMEL, 1.5, "base3"), rtol=0, atol=0)


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(_NUMEL, dtype=torch.float64),
        torch.zeros(_NUMEL + 1),
        torch.zeros(1, _NUMEL),
        torch.zeros(2 * _NUMEL)[::2],
    ],
    ids=["float64", "wrong-size", "2-D", "strided"],
)
def test_unpack_rejects_a_bad_buffer(bad: torch.Tensor) -> None:
    packed = torch.zeros(packed_size(_NUMEL, "2bit"), dtype=torch.uint8)
    with pytest.raises(ValueError, match="out must be"):
        unpack_codes(packed, _NUMEL, 1.0, "2bit", out=bad)


# empty, single partial bytes, and sizes either side of an unpack chunk and a touch segment
_BATCH_SIZES = [0, 1, 3, 4, 5, 1001, 4 * 5 * (1 << 16) - 1, 7, 4 * 5 * (1 << 18) + 9, 2]


def _batch(codec: str, seed: int) -> tuple[list[tuple[torch.Tensor, int, float]], list[np.ndarray]]:
    """Packed random codes of every size, and what each must decode to (numpy, no LUT)."""
    rng = np.random.default_rng(seed)
    items, expected = [], []
    for index, numel in enumerate(_BATCH_SIZES):
        codes = rng.integers(0, 3, numel).astype(np.uint8)
        scale = 0.5 + index
        items.append((pack_codes(torch.from_numpy(codes), codec), numel, scale))
        expected.append(np.array([0.0, scale, -scale], dtype=np.float32)[codes])
    return items, expected


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_a_batch_into_buffers_decodes_every_tensor(threads: int, codec: str) -> None:
    items, expected = _batch(codec, threads)
    buffers = [torch.full((numel,), float("nan")) for _, numel, _ in items]
    unpack_codes_batch(
        [(p, n, s, codec, b) for (p, n, s), b in zip(items, buffers, strict=True)]
    )
    for buffer, reference in zip(buffers, expected, strict=True):
        np.testing.assert_array_equal(buffer.numpy(), reference)


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_a_batch_into_new_tensors_decodes_every_tensor(threads: int, codec: str) -> None:
    items, expected = _batch(codec, threads + 10)
    decoded = unpack_codes_new([(p, n, s, codec) for p, n, s in items])
    for tensor, reference in zip(decoded, expected, strict=True):
        assert tensor.dtype == torch.float32
        np.testing.assert_array_equal(tensor.numpy(), reference)
