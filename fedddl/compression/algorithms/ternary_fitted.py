"""Deterministic threshold ternary with a least-squares scale (``ternary-fitted-base3``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedddl.compression.algorithms.payload import Context, Payload, TernaryPayload
from fedddl.compression.algorithms.ternary import TernaryCompressor

__all__ = ["FittedTernaryCompressor"]


class FittedTernaryCompressor(TernaryCompressor):
    """Threshold ternary codes sent with the scale that fits them best.

    Per tensor: the codes of :class:`TernaryCompressor` in deterministic mode (``sign(g)``
    where ``|g| > threshold * s_c``, ``s_c = min(max|g|, clip_sigma * sigma)``), base-3
    packed; the scale sent is the mean ``|g|`` over the non-zero codes, which minimises
    ``||g - s * codes||`` for those codes, so the error is below that of ``s_c`` and below
    ``||g||`` (contractive, as error feedback needs).
    Same wire format and decoder as ``ternary-threshold-base3``; no shared scales.

    Parameters
    ----------
    clip_sigma, seed, min_numel
        As :class:`TernaryCompressor` (``seed`` is unused: no randomness).
    threshold : float
        The cut, as a fraction of ``s_c``, in ``[0, 1]``.
    """

    ternary = False  # no shared scale (``scale=``): the scale is fitted per tensor
    configurable = True  # built with the caller's clip_sigma; scale_bucket is refused

    def __init__(
        self,
        clip_sigma: float | None = 2.5,
        seed: int = 0,
        threshold: float = 0.5,
        min_numel: int = 0,
    ) -> None:
        super().__init__(clip_sigma, seed, True, threshold, min_numel, codec="base3")
        self.name = "ternary-fitted-base3"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(clip_sigma={self.clip_sigma}, "
            f"threshold={self.threshold}, min_numel={self.min_numel})"
        )

    def _compress_many(
        self,
        tensors: Sequence[torch.Tensor],
        scales: Sequence[float | None] | None,
        label_errors: bool,
    ) -> list[tuple[Payload, Context]]:
        if scales is not None and any(scale is not None for scale in scales):
            raise ValueError("ternary-fitted-base3 takes no shared scale")
        results = super()._compress_many(tensors, None, label_errors)
        return [
            (self._fit(payload, tensor), ctx)
            for (payload, ctx), tensor in zip(results, tensors, strict=True)
        ]

    def _fit(self, payload: Payload, tensor: torch.Tensor) -> Payload:
        """``payload`` with the least-squares scale of its codes."""
        if not isinstance(payload, TernaryPayload) or payload.scale == 0.0:
            return payload
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32).numpy()
        magnitude = np.abs(flat)
        fired = magnitude[magnitude > np.float32(self.threshold * payload.scale)]
        if fired.size == 0:
            return payload
        scale = float(np.float32(fired.mean(dtype=np.float64)))
        return TernaryPayload(payload.codes, scale, payload.numel, payload.codec)
