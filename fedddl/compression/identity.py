"""The uncompressed baseline: values are sent as they are."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fedddl.compression.base import Compressor
from fedddl.compression.payload import Context, DensePayload, Payload, check_float_tensor

__all__ = ["IdentityCompressor"]


class IdentityCompressor(Compressor):
    """Sends every tensor uncompressed in its own dtype (fp32 for fp32); bit-exact."""

    name = "identity"

    def compress(
        self, tensor: torch.Tensor, *, scale: float | None = None
    ) -> tuple[Payload, Context]:
        """Return a copy of ``tensor`` as a :class:`DensePayload`.

        Raises
        ------
        ValueError
            If ``tensor`` has NaN/Inf values or ``scale`` is given.
        """
        payload, ctx = self._checked(tensor, scale)
        return DensePayload(payload.values.clone()), ctx

    def compress_batch(
        self, tensors: Sequence[torch.Tensor], scales: Sequence[float | None] | None = None
    ) -> list[tuple[Payload, Context]]:
        """:meth:`compress` of each tensor, without the copy: a payload shares memory
        with its (contiguous) input, which :func:`~fedddl.compression.encode_update`
        serialises at once, so the message costs one memory copy."""
        scales = [None] * len(tensors) if scales is None else list(scales)
        if len(scales) != len(tensors):
            raise ValueError(f"{len(scales)} scales for {len(tensors)} tensors")
        return [self._checked(t, s) for t, s in zip(tensors, scales, strict=True)]

    @staticmethod
    def _checked(tensor: torch.Tensor, scale: float | None) -> tuple[DensePayload, Context]:
        check_float_tensor(tensor)
        if scale is not None:
            raise ValueError("IdentityCompressor has no scale; do not pass scale=")
        values = tensor.detach().contiguous()
        if values.numel() and not _all_finite(values):
            raise ValueError("tensor has NaN or Inf values")
        return DensePayload(values), Context(tuple(values.shape), values.dtype)


def _all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite, in one read and no temporary tensor.

    A NaN or an infinity makes the sum NaN or infinite, so a finite sum proves every
    value finite (numpy's SIMD sum, float32/float64 on the CPU); only a non-finite sum
    (or an overflow of finite values) needs the exact test: min and max are finite
    (NaN propagates through both).
    """
    flat = values.reshape(-1)
    summable = flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64)
    if summable and math.isfinite(float(np.einsum("i->", flat.numpy()))):
        return True
    low, high = torch.aminmax(flat)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))
