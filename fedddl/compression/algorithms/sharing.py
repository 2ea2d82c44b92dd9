"""TernGrad scaler sharing: every worker ternarises with the max of all local scalers.

Round trip for a strategy::

    mine = local_scales(grads, compressor, memory)      # worker -> server (small)
    shared = max_scales([mine, theirs, ...])            # server -> workers
    data = encode_update(grads, compressor, memory, scales=shared)

With ``s_shared >= s_local``, ``b ~ Bernoulli(|g| / s_shared)`` stays unbiased.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fedddl.compression.algorithms.base import Compressor
from fedddl.compression.algorithms.memory import Memory

__all__ = ["local_scales", "max_scales"]


def local_scales(
    named_tensors: Mapping[str, torch.Tensor],
    compressor: Compressor,
    memory: Memory | None = None,
) -> dict[str, float]:
    """Local scalers of the (compensated) tensors that have one; the memory is unchanged."""
    scales: dict[str, float] = {}
    for name, tensor in named_tensors.items():
        compensated = tensor if memory is None else memory.compensate(name, tensor)
        try:
            scale = compressor.local_scale(compensated)
        except ValueError as error:
            raise ValueError(f"tensor {name!r}: {error}") from error
        if scale is not None:
            scales[name] = scale
    return scales


def max_scales(per_worker: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Element-wise max of the workers' scalers (names missing somewhere are kept).

    Raises
    ------
    ValueError
        If a scale is negative or not finite.
    """
    shared: dict[str, float] = {}
    for scales in per_worker:
        for name, scale in scales.items():
            if not (isinstance(scale, (int, float)) and 0 <= scale < float("inf")):
                raise ValueError(f"scale of {name!r} must be finite and >= 0, got {scale!r}")
            shared[name] = max(shared.get(name, 0.0), float(scale))
    return shared
