"""Vectorised TernGrad ternarisation fused with packing.

Stochastic rounding compares integers instead of drawing random floats.  For
an element ``g`` with scaler ``s`` let ``a = |g| * 2**16 / s - 1/2`` and ``r``
a uniform integer in ``0 .. 2**16 - 1`` (16 random bits); the element fires
(becomes ``sign(g) * s``) iff ``r < a``.  So

    P(fire) = ceil(|g| * 2**16 / s - 1/2) / 2**16,

i.e. the Bernoulli probability ``|g| / s`` rounded to the nearest multiple of
``2**-16``.  The decoded value's bias is therefore at most ``2**-17 * s`` in
magnitude per element, and exactly zero for ``g = 0`` (never fires) and
``|g| = s`` (always fires).

The work is done in cache-sized chunks (one read of the input, small
temporaries) by up to ``torch.get_num_threads()`` threads (numpy releases the
GIL).  Chunk ``i`` always uses the random words at its own fixed offset of the
stream (PCG64 ``advance``), so codes depend on the seed only, never on the
number of threads.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from fedddl.compression.packing import codes_per_byte, pack_codes_into, packed_size

__all__ = [
    "CHUNK",
    "PROBABILITY_BITS",
    "RandomBits",
    "run_in_chunks",
    "ternarize_deterministic",
    "ternarize_stochastic",
]

#: Resolution of the Bernoulli probabilities: they are multiples of 2**-PROBABILITY_BITS.
PROBABILITY_BITS = 16
_STEPS = float(1 << PROBABILITY_BITS)
_VALUES_PER_WORD = 4  # 16-bit random integers per 64-bit PCG64 output
#: Elements per chunk of work (fixed, so results never depend on the thread count).
CHUNK = 5 * 4 * 4096  # a multiple of 4 and 5: only the last chunk needs padding
_MAX_WORKERS = 8
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_MAX_WORKERS, thread_name_prefix="fedddl-tern")
    return _pool


class RandomBits:
    """A seedable stream of uniform 16-bit integers (numpy PCG64) with random access."""

    def __init__(self, seed: int) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self._bitgen = np.random.PCG64(seed)

    def fork(self, offset_values: int) -> np.random.PCG64:
        """A generator positioned ``offset_values`` 16-bit values ahead (a multiple of 4)."""
        forked = np.random.PCG64()
        forked.state = self._bitgen.state
        forked.advance(offset_values // _VALUES_PER_WORD)
        return forked

    def skip(self, count: int) -> None:
        """Advance the stream past ``count`` values (rounded up to whole 64-bit words)."""
        self._bitgen.advance(-(-count // _VALUES_PER_WORD))


def _uint16(bitgen: np.random.PCG64, count: int) -> np.ndarray:
    return bitgen.random_raw(-(-count // _VALUES_PER_WORD)).view(np.uint16)[:count]


def _codes_from_masks(fire: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """``uint8`` codes: 0 where not firing, 1 where firing and positive, 2 where negative."""
    np.bitwise_and(negative, fire, out=negative)
    codes = fire.view(np.uint8)
    codes += negative.view(np.uint8)
    return codes


def _ranges(numel: int) -> list[tuple[int, int]]:
    """Split ``0..numel`` into per-thread ranges of whole chunks."""
    chunks = -(-numel // CHUNK)
    workers = max(1, min(torch.get_num_threads(), _MAX_WORKERS, chunks))
    per = -(-chunks // workers) * CHUNK
    return [(lo, min(lo + per, numel)) for lo in range(0, numel, per)]


def run_in_chunks(work: Callable[[int, int], None], numel: int) -> None:
    """Call ``work(lo, hi)`` on per-thread ranges of whole chunks covering ``0..numel``."""
    ranges = _ranges(numel)
    if len(ranges) == 1:
        work(*ranges[0])
        return
    futures = [_executor().submit(work, lo, hi) for lo, hi in ranges]
    for future in futures:
        future.result()


def ternarize_stochastic(
    flat: torch.Tensor,
    scale: float,
    clip_bound: float | None,
    bits: RandomBits,
    codec: str = "2bit",
) -> torch.Tensor:
    """Stochastically ternarise and pack a 1-D float32 tensor.

    Parameters
    ----------
    flat:
        1-D contiguous float32 values, all finite.
    scale:
        The scaler ``s > 0``.  Values with ``|g| >= s`` always fire.
    clip_bound:
        Clip ``|g|`` to this bound first; only needed when it is below ``scale``
        (a shared scale), ``None``: no clipping.
    bits:
        Source of random integers; advanced by ``flat.numel()`` values.
    codec:
        Packing codec.

    Returns
    -------
    torch.Tensor
        Packed ``uint8`` codes.
    """
    per = codes_per_byte(codec)
    values = flat.numpy()
    numel = values.size
    out = np.empty(packed_size(numel, codec), dtype=np.uint8)
    factor = np.float32(_STEPS / scale)
    limit = None if clip_bound is None or clip_bound >= scale else np.float32(clip_bound * factor)

    def work(lo: int, hi: int) -> None:
        bitgen = bits.fork(lo)
        level = np.empty(min(CHUNK, hi - lo), dtype=np.float32)
        fire = np.empty(level.size, dtype=bool)
        negative = np.empty(level.size, dtype=bool)
        for start in range(lo, hi, CHUNK):
            chunk = values[start : min(start + CHUNK, hi)]
            size = chunk.size
            rand = _uint16(bitgen, size)
            a, f, n = level[:size], fire[:size], negative[:size]
            np.abs(chunk, out=a)
            np.multiply(a, factor, out=a)
            if limit is not None:
                np.minimum(a, limit, out=a)
            np.subtract(a, np.float32(0.5), out=a)
            np.greater(a, rand, out=f)
            np.signbit(chunk, out=n)
            codes = _codes_from_masks(f, n)
            first = start // per
            pack_codes_into(codes, out[first : first + packed_size(size, codec)], codec)

    run_in_chunks(work, numel)
    bits.skip(numel)
    return torch.from_numpy(out)


def ternarize_deterministic(
    flat: torch.Tensor,
    scale: float,
    clip_bound: float | None,
    threshold: float,
    codec: str = "2bit",
) -> torch.Tensor:
    """Deterministically ternarise and pack: ``sign(g)`` where ``|g_clipped| > threshold * s``."""
    per = codes_per_byte(codec)
    values = flat.numpy()
    numel = values.size
    out = np.zeros(packed_size(numel, codec), dtype=np.uint8)
    cut = np.float32(threshold * scale)
    if clip_bound is not None and clip_bound <= cut:
        return torch.from_numpy(out)  # every clipped magnitude is at most the cut

    def work(lo: int, hi: int) -> None:
        for start in range(lo, hi, CHUNK):
            chunk = values[start : min(start + CHUNK, hi)]
            fire = np.greater(np.abs(chunk), cut)
            codes = _codes_from_masks(fire, np.signbit(chunk))
            first = start // per
            pack_codes_into(codes, out[first : first + packed_size(chunk.size, codec)], codec)

    run_in_chunks(work, numel)
    return torch.from_numpy(out)
