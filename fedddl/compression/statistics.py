"""One chunked, threaded pass computing what TernGrad needs of a tensor.

Per fixed-size chunk: min, max, sum and sum of squares; the chunk results are
combined in chunk order in float64, so the statistics (hence the scaler and
the codes) do not depend on the number of threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedddl.compression.parallel import run_in_chunks

__all__ = ["TensorStatistics", "tensor_statistics"]

#: Elements per chunk: reductions stream, so chunks can be larger than the ternariser's.
CHUNK = 1 << 18
# below this share of E[g^2], E[g^2] - mean^2 has lost too many digits: use two passes
_CANCELLATION_GUARD = 1e-3


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
    values = flat.numpy()
    numel = values.size
    chunks = -(-numel // CHUNK)
    lows = np.empty(chunks)
    highs = np.empty(chunks)
    sums = np.zeros(chunks)
    squares = np.zeros(chunks)

    def work(lo: int, hi: int) -> None:
        for start in range(lo, hi, CHUNK):
            chunk = values[start : min(start + CHUNK, hi)]
            index = start // CHUNK
            lows[index] = chunk.min()
            highs[index] = chunk.max()
            if with_std:
                # float32 within a chunk (SIMD lanes), chunks add in float64
                sums[index] = np.einsum("i->", chunk)
                squares[index] = np.einsum("i,i->", chunk, chunk)

    run_in_chunks(work, numel, CHUNK)
    low, high = float(lows.min()), float(highs.max())
    if not (math.isfinite(low) and math.isfinite(high)) or not math.isfinite(float(squares.sum())):
        raise ValueError("tensor has NaN or Inf values (or values beyond float32 range)")
    peak = max(-low, high)
    if not with_std:
        return TensorStatistics(peak, math.nan)
    mean = float(sums.sum()) / numel
    mean_square = float(squares.sum()) / numel
    variance = mean_square - mean * mean
    if variance < _CANCELLATION_GUARD * mean_square:
        variance = float(np.var(values, dtype=np.float64))
    return TensorStatistics(peak, math.sqrt(max(variance, 0.0)))
