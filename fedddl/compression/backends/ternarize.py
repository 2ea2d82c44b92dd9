"""Vectorised TernGrad ternarisation fused with packing.

An element ``g`` with scaler ``s`` fires (becomes ``sign(g) * s``) iff ``r < a`` with
``a = |g| * 2**16 / s - 1/2`` in float32 and ``r`` a uniform 16-bit integer, so
``P(fire) = |g| / s`` rounded to a multiple of ``2**-16`` (bias at most ``2**-17 * s``).
The integers come from numpy's PCG64DXSM, four per 64-bit word; value ``i`` of a tensor
uses the ``i``-th value after the tensor's start in the stream (each tensor starts on a
whole word), so codes depend on the seed and the order of the tensors only, never on the
threads, the chunk size (:data:`CHUNK`) or the batching.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import numpy as np
import torch

from fedddl.compression.backends.jit import jit_kernels
from fedddl.compression.backends.packing import (
    PACK_SLACK,
    codes_per_byte,
    pack_padded_codes,
    packed_size,
)
from fedddl.compression.backends.parallel import chunk_units, run_in_chunks, run_units

__all__ = [
    "CHUNK",
    "PROBABILITY_BITS",
    "RandomBits",
    "ternarize_deterministic",
    "ternarize_stochastic",
    "ternarize_stochastic_batch",
]

#: Resolution of the Bernoulli probabilities: they are multiples of 2**-PROBABILITY_BITS.
PROBABILITY_BITS = 16
_STEPS = float(1 << PROBABILITY_BITS)
_VALUES_PER_WORD = 4  # 16-bit random integers per 64-bit PCG64DXSM output
#: Elements per chunk of work: whole blocks of the compiled kernel (4,000 values, a multiple
#: of 4 and 5, so only a tensor's last chunk has a partial block or byte), large enough that
#: GIL hand-overs between threads are rare, small enough for L2.
CHUNK = 80 * 4000
_LOW_64 = (1 << 64) - 1
_FIXED_SEED = np.random.SeedSequence(0)  # for generators whose state is set right after
_scratch_generators = threading.local()


class RandomBits:
    """A seedable stream of uniform 16-bit integers (numpy PCG64DXSM) with random access."""

    def __init__(self, seed: int) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self._bitgen = np.random.PCG64DXSM(seed)

    def fork(self, offset_values: int) -> np.random.PCG64DXSM:
        """A generator positioned ``offset_values`` 16-bit values ahead (a multiple of 4)."""
        return self._position(np.random.PCG64DXSM(_FIXED_SEED), offset_values)

    def _scratch(self, offset_values: int) -> np.random.PCG64DXSM:
        """:meth:`fork` into this thread's scratch generator (valid until this thread's
        next call): creating a generator costs more than drawing a small tensor's codes."""
        scratch: np.random.PCG64DXSM | None = getattr(_scratch_generators, "pcg", None)
        if scratch is None:
            scratch = _scratch_generators.pcg = np.random.PCG64DXSM(_FIXED_SEED)
        return self._position(scratch, offset_values)

    def _position(
        self, generator: np.random.PCG64DXSM, offset_values: int
    ) -> np.random.PCG64DXSM:
        """``generator`` (its own seed irrelevant) set ``offset_values`` values ahead."""
        generator.state = self._bitgen.state
        generator.advance(offset_values // _VALUES_PER_WORD)
        return generator

    def state_at(self, offset_values: int) -> np.ndarray:
        """The generator state ``offset_values`` values ahead (a multiple of 4), as the four
        ``uint64`` (state high, state low, increment high, increment low) that the
        compiled kernels take (:mod:`fedddl.compression.backends.kernels`)."""
        state = self._scratch(offset_values).state["state"]
        words = (state["state"] >> 64, state["state"], state["inc"] >> 64, state["inc"])
        return np.array([w & _LOW_64 for w in words], dtype=np.uint64)

    def skip(self, count: int) -> None:
        """Advance the stream past ``count`` values (rounded up to whole 64-bit words)."""
        self._bitgen.advance(-(-count // _VALUES_PER_WORD))


def _uint16(bitgen: np.random.PCG64DXSM, count: int) -> np.ndarray:
    return bitgen.random_raw(-(-count // _VALUES_PER_WORD)).view(np.uint16)[:count]


def _codes_from_masks(fire: np.ndarray, negative: np.ndarray, codes: np.ndarray) -> None:
    """Write ``uint8`` codes to ``codes[:fire.size]``: 0 where not firing, 1 where
    firing and positive, 2 where firing and negative (``negative`` is scratch)."""
    np.bitwise_and(negative, fire, out=negative)
    np.add(fire.view(np.uint8), negative.view(np.uint8), out=codes[: fire.size])


def _touched_bytes(size: int) -> np.ndarray:
    """A new byte array, first touched by this thread, not the workers (docs/ARCHITECTURE.md)."""
    out = np.empty(size, dtype=np.uint8)
    out.fill(0)
    return out


def ternarize_stochastic(
    flat: torch.Tensor,
    scale: float,
    clip_bound: float | None,
    bits: RandomBits,
    codec: str = "2bit",
) -> torch.Tensor:
    """Stochastically ternarise 1-D contiguous finite float32 ``flat``; return the packed codes.

    ``scale`` is the scaler ``s > 0`` (values with ``|g| >= s`` always fire); ``clip_bound``
    clips ``|g|`` first when below ``scale`` (``None``: no clipping); ``bits`` is advanced
    by ``flat.numel()`` values; ``codec`` is the packing codec. Returns ``uint8`` codes.
    """
    return ternarize_stochastic_batch([flat], [scale], [clip_bound], bits, codec)[0]


def ternarize_stochastic_batch(
    flats: Sequence[torch.Tensor],
    scales: Sequence[float],
    clip_bounds: Sequence[float | None],
    bits: RandomBits,
    codec: str = "2bit",
) -> list[torch.Tensor]:
    """:func:`ternarize_stochastic` of several tensors in one threaded pass.

    The result is bit-identical to calling :func:`ternarize_stochastic` on
    each tensor in order: tensor ``k`` takes the random values that follow
    those of tensors ``0 .. k-1`` (each rounded up to whole 64-bit words),
    and ``bits`` ends up advanced past all of them.  The chunks of all
    tensors are shared out over the threads, so many small tensors run as
    fast as one large one.
    """
    per = codes_per_byte(codec)
    arrays = [flat.numpy() for flat in flats]
    outs = [_touched_bytes(packed_size(values.size, codec)) for values in arrays]
    factors = [np.float32(_STEPS / scale) for scale in scales]
    limits = [
        None if bound is None or bound >= scale else np.float32(bound * factor)
        for bound, scale, factor in zip(clip_bounds, scales, factors, strict=True)
    ]
    # tensor k's first random value, counted from the stream's position
    bases = list(itertools.accumulate((-(-v.size // 4) * 4 for v in arrays), initial=0))
    sizes = [values.size for values in arrays]
    kernels = jit_kernels(sum(sizes))
    # one thread: one kernel call per tensor (chunks only share the work out over threads)
    span = max(sizes, default=1) if kernels is not None and torch.get_num_threads() == 1 else CHUNK
    units, weights = chunk_units(sizes, max(span, 1))

    def work_jit(first: int, stop: int) -> None:
        assert kernels is not None
        state: np.ndarray | None = None
        position = -1
        for k, start in units[first:stop]:
            if state is None or bases[k] + start != position:  # not where the last chunk ended
                state = bits.state_at(bases[k] + start)
            chunk = arrays[k][start : start + span]
            size = chunk.size
            position = bases[k] + start + -(-size // 4) * 4  # the kernel draws whole words
            first_byte = start // per
            target = outs[k][first_byte : first_byte + packed_size(size, codec)]
            limit = limits[k]
            kernels.ternarize_pack(
                chunk,
                state,
                factors[k],
                np.float32(np.inf) if limit is None else limit,
                target,
                codec == "base3",
            )

    def work(first: int, stop: int) -> None:
        largest = max(weights[first:stop])
        level = np.empty(largest, dtype=np.float32)
        fire = np.empty(largest, dtype=bool)
        negative = np.empty(largest, dtype=bool)
        codes = np.empty(largest + PACK_SLACK, dtype=np.uint8)
        bitgen: np.random.PCG64DXSM | None = None
        position = -1
        for k, start in units[first:stop]:
            if bitgen is None or bases[k] + start != position:  # not where the last chunk ended
                bitgen = bits._scratch(bases[k] + start)
            chunk = arrays[k][start : start + CHUNK]
            size = chunk.size
            rand = _uint16(bitgen, size)
            position = bases[k] + start + size
            a, f, n = level[:size], fire[:size], negative[:size]
            np.abs(chunk, out=a)
            np.multiply(a, factors[k], out=a)
            limit = limits[k]
            if limit is not None:
                np.minimum(a, limit, out=a)
            np.subtract(a, np.float32(0.5), out=a)
            np.greater(a, rand, out=f)
            np.signbit(chunk, out=n)
            _codes_from_masks(f, n, codes)
            first_byte = start // per
            target = outs[k][first_byte : first_byte + packed_size(size, codec)]
            pack_padded_codes(codes, size, target, codec)

    run_units(work if kernels is None else work_jit, weights, CHUNK)
    bits.skip(bases[-1])  # past every tensor's values, each rounded up to whole words
    return [torch.from_numpy(out) for out in outs]


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
    out = _touched_bytes(packed_size(numel, codec))
    cut = np.float32(threshold * scale)
    if clip_bound is not None and clip_bound <= cut:
        return torch.from_numpy(out)  # every clipped magnitude is at most the cut

    def work(lo: int, hi: int) -> None:
        codes = np.empty(min(CHUNK, hi - lo) + PACK_SLACK, dtype=np.uint8)
        for start in range(lo, hi, CHUNK):
            chunk = values[start : min(start + CHUNK, hi)]
            fire = np.greater(np.abs(chunk), cut)
            _codes_from_masks(fire, np.signbit(chunk), codes)
            first = start // per
            target = out[first : first + packed_size(chunk.size, codec)]
            pack_padded_codes(codes, chunk.size, target, codec)

    run_in_chunks(work, numel, CHUNK)
    return torch.from_numpy(out)
