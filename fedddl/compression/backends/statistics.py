"""One chunked, threaded pass computing what TernGrad needs of a tensor: ``max|g|`` and
the population std.

Chunk results are combined in a fixed order in float64, so the statistics (hence the
scaler and the codes) never depend on the number of threads. Tensors of
:data:`LANE_MIN_NUMEL` values or more are summed in 16 float64 lanes combined exactly
(the compiled kernel and numpy give the same bits); smaller ones in float32 chunks,
summed again in float64 if those overflow, so every finite tensor has finite statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedddl.compression.backends.jit import jit_kernels
from fedddl.compression.backends.parallel import chunk_units, run_units

__all__ = [
    "LANE_MIN_NUMEL",
    "TensorStatistics",
    "all_finite_array",
    "tensor_statistics",
    "tensor_statistics_batch",
]

#: Elements per chunk of the reductions.  Fixed, because the float32 sums within a chunk
#: (hence the clip bound, the scale and the codes) depend on where chunks start.
CHUNK = 1 << 18
# below this share of E[g^2], E[g^2] - mean^2 has lost too many digits: use two passes
_CANCELLATION_GUARD = 1e-3
#: Tensors with at least this many values are summed in float64 lanes (see above).
LANE_MIN_NUMEL = 1 << 16
_LANES = 16  # fedddl.compression.backends.kernels.LANES (not imported: numba is optional)


@dataclass(frozen=True)
class TensorStatistics:
    """``peak = max|g|`` and the population standard deviation ``std``."""

    peak: float
    std: float


def tensor_statistics(flat: torch.Tensor, with_std: bool = True) -> TensorStatistics:
    """Statistics of a 1-D contiguous float32 tensor with at least one element.

    Raises
    ------
    ValueError
        If any value is NaN or infinite.
    """
    return tensor_statistics_batch([flat], with_std)[0]


def tensor_statistics_batch(
    flats: Sequence[torch.Tensor],
    with_std: bool = True,
    *,
    labels: Sequence[str] | None = None,
) -> list[TensorStatistics]:
    """:func:`tensor_statistics` of several tensors in one threaded pass.

    The chunks of all tensors are shared out over the threads; each tensor's
    result is bit-identical to :func:`tensor_statistics` of it alone.

    Raises
    ------
    ValueError
        If a tensor has a NaN or infinite value (prefixed with its label,
        if ``labels`` are given).
    """
    arrays = [flat.numpy() for flat in flats]
    counts = [-(-values.size // CHUNK) for values in arrays]
    lows = [np.empty(count) for count in counts]
    highs = [np.empty(count) for count in counts]
    sums = [np.zeros(count) for count in counts]
    squares = [np.zeros(count) for count in counts]
    # per chunk of a lane-summed tensor: lane sums, lane sums of squares, peak in [2, 0]
    lanes = [
        np.zeros((count, 3, _LANES)) if values.size >= LANE_MIN_NUMEL else None
        for values, count in zip(arrays, counts, strict=True)
    ]
    units, weights = chunk_units([values.size for values in arrays], CHUNK)
    kernels = jit_kernels(max((values.size for values in arrays), default=0))

    def work(first: int, stop: int) -> None:
        for k, start in units[first:stop]:
            chunk = arrays[k][start : start + CHUNK]
            index = start // CHUNK
            by_lane = lanes[k]
            if by_lane is not None:
                if kernels is not None:
                    kernels.lane_statistics(chunk, by_lane[index])
                else:
                    _lane_statistics(chunk, by_lane[index])
                continue
            lows[k][index] = chunk.min()
            highs[k][index] = chunk.max()
            if with_std:
                # float32 within a chunk (SIMD lanes), chunks add in float64
                sums[k][index] = np.einsum("i->", chunk)
                squares[k][index] = np.einsum("i,i->", chunk, chunk)

    run_units(work, weights, CHUNK)
    results = []
    for k, values in enumerate(arrays):
        try:
            by_lane = lanes[k]
            if by_lane is not None:
                results.append(_combine_lanes(values, by_lane, with_std))
                continue
            results.append(_combine(values, lows[k], highs[k], sums[k], squares[k], with_std))
        except ValueError as error:
            raise ValueError(str(error) if labels is None else f"{labels[k]}: {error}") from None
    return results


def _lane_statistics(chunk: np.ndarray, out: np.ndarray) -> None:
    """numpy's :func:`fedddl.compression.backends.kernels.lane_statistics`, bit for bit (a
    reduction over axis 0 adds the rows in order, one lane per column)."""
    wide = chunk.astype(np.float64)
    whole = wide.size - wide.size % _LANES
    rows = wide[:whole].reshape(-1, _LANES)
    out[0] = rows.sum(axis=0)
    out[1] = np.square(rows).sum(axis=0)
    for j in range(wide.size - whole):
        out[0, j] += wide[whole + j]
        out[1, j] += wide[whole + j] * wide[whole + j]
    out[2, 0] = float(np.abs(chunk).max())


def _combine_lanes(values: np.ndarray, by_lane: np.ndarray, with_std: bool) -> TensorStatistics:
    """One tensor's statistics from the lane sums of its chunks (summed exactly)."""
    if not np.isfinite(by_lane[:, :2]).all():  # finite float32 values cannot overflow here
        raise ValueError("tensor has NaN or Inf values")
    total, total_square = math.fsum(by_lane[:, 0].ravel()), math.fsum(by_lane[:, 1].ravel())
    peak = float(by_lane[:, 2, 0].max())
    if not with_std:
        return TensorStatistics(peak, math.nan)
    return TensorStatistics(peak, _std(values, total, total_square))


def _std(values: np.ndarray, total: float, total_square: float) -> float:
    """The population std from the sums, or from two float64 passes if they cancel."""
    numel = values.size
    mean = total / numel
    mean_square = total_square / numel
    variance = mean_square - mean * mean
    if variance < _CANCELLATION_GUARD * mean_square:
        variance = float(np.var(values, dtype=np.float64))
    return math.sqrt(max(variance, 0.0))


def _combine(
    values: np.ndarray,
    lows: np.ndarray,
    highs: np.ndarray,
    sums: np.ndarray,
    squares: np.ndarray,
    with_std: bool,
) -> TensorStatistics:
    """One tensor's statistics from its per-chunk ones, combined in chunk order."""
    if lows.size == 1:  # one chunk (every tensor below LANE_MIN_NUMEL): no reductions
        low, high = float(lows[0]), float(highs[0])
    else:
        low, high = float(lows.min()), float(highs.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError("tensor has NaN or Inf values")
    peak = max(-low, high)
    if not with_std:
        return TensorStatistics(peak, math.nan)
    if sums.size == 1:  # the sum of one value is that value
        total, total_square = float(sums[0]), float(squares[0])
    else:
        total, total_square = float(sums.sum()), float(squares.sum())
    if not (math.isfinite(total) and math.isfinite(total_square)):
        # finite values whose float32 chunk sums overflowed: sum again in float64
        wide = values.astype(np.float64)
        total, total_square = float(wide.sum()), float(np.dot(wide, wide))
    return TensorStatistics(peak, _std(values, total, total_square))


def all_finite_array(values: np.ndarray[Any, Any]) -> bool:
    """Whether every value of a float32/float64 array is finite, in one read and no
    temporary array.

    A NaN or an infinity makes the sum NaN or infinite, so a finite sum proves every
    value finite (numpy's SIMD sum; ``add.reduce``, not ``einsum``, whose call costs
    ~10 us on a model's many small tensors); only a non-finite sum (or an overflow of
    finite values) needs the exact test.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # overflow/NaN are what we test
        total = float(np.add.reduce(values))
    return math.isfinite(total) or bool(np.isfinite(values).all())
