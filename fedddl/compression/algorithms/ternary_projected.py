"""Threshold ternary with the scale that keeps the update's length along itself
(``ternary-projected-base3``)."""

from __future__ import annotations

import numpy as np
import torch

from fedddl.compression.algorithms.payload import Payload, TernaryPayload
from fedddl.compression.algorithms.ternary_fitted import FittedTernaryCompressor

__all__ = ["PROJECTION_CAP", "ProjectedTernaryCompressor"]

#: The scale never exceeds this many times the least-squares scale ``m`` (the mean ``|g|``
#: over the non-zero codes): ``||g - s * codes||^2 = ||g||^2 - nnz * m^2 * (1 - (s/m - 1)^2)``
#: stays below ``||g||^2`` for ``s < 2m``, so the cap keeps it contractive, as error feedback
#: needs, whatever the values' distribution.
PROJECTION_CAP = 1.9


class ProjectedTernaryCompressor(FittedTernaryCompressor):
    """Threshold ternary codes sent with the scale whose projection on ``g`` is ``g``'s own.

    Per tensor: ``g`` clipped to ``s_c = min(max|g|, clip_sigma * sigma)``; the codes of
    :class:`~fedddl.compression.algorithms.ternary.TernaryCompressor` in deterministic mode
    (``sign(g)`` where ``|g| > threshold * s_c``); the scale ``s = ||g||^2 / sum |g|`` over
    the non-zero codes, so ``<s * codes, g> = ||g||^2``: the decoded update moves as far
    along ``g`` as ``g`` itself (the least-squares scale of ``ternary-fitted-base3`` moves
    less, the clip scale of ``ternary-threshold-base3`` more or less with the cut), and
    the error, which error feedback sends later, is orthogonal to ``g``. Capped at
    :data:`PROJECTION_CAP` times the least-squares scale. Same wire format and decoder as
    ``ternary-threshold-base3``.

    Parameters
    ----------
    clip_sigma, seed, threshold, min_numel
        As :class:`~fedddl.compression.algorithms.ternary_fitted.FittedTernaryCompressor`.
    """

    def __init__(
        self,
        clip_sigma: float | None = 2.5,
        seed: int = 0,
        threshold: float = 0.35,
        min_numel: int = 0,
    ) -> None:
        super().__init__(clip_sigma, seed, threshold, min_numel)
        self.name = "ternary-projected-base3"

    def _fit(self, payload: Payload, tensor: torch.Tensor) -> Payload:
        """``payload`` with the projection-keeping scale of its codes."""
        if not isinstance(payload, TernaryPayload) or payload.scale == 0.0:
            return payload
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32).numpy()
        values = np.clip(flat.astype(np.float64), -payload.scale, payload.scale)
        magnitude = np.abs(values)
        fired = magnitude > self.threshold * payload.scale
        count = int(fired.sum())
        if count == 0:
            return payload
        energy = float((values * values).sum())
        carried = float(magnitude[fired].sum())
        scale = min(energy / carried, PROJECTION_CAP * carried / count)
        return TernaryPayload(payload.codes, float(np.float32(scale)), payload.numel,
                              payload.codec)
