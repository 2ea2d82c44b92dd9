"""The uncompressed baseline: values are sent as they are."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedddl.compression.algorithms.base import Compressor
from fedddl.compression.algorithms.payload import Context, DensePayload, Payload, check_float_tensor
from fedddl.compression.backends.statistics import all_finite_array

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
        self,
        tensors: Sequence[torch.Tensor],
        scales: Sequence[float | None] | None = None,
        *,
        defer_float32_check: bool = False,
    ) -> list[tuple[Payload, Context]]:
        """:meth:`compress` of each tensor, without the copy: a payload shares memory
        with its (contiguous) input, which :func:`~fedddl.compression.encode_update`
        serialises at once, so the message costs one memory copy.

        With ``defer_float32_check``, float32 CPU tensors are not checked for NaN/Inf
        here: the caller checks them while copying them (``encode_update(into=)``).
        """
        scales = [None] * len(tensors) if scales is None else list(scales)
        if len(scales) != len(tensors):
            raise ValueError(f"{len(scales)} scales for {len(tensors)} tensors")
        return [
            self._checked(t, s, defer_float32_check)
            for t, s in zip(tensors, scales, strict=True)
        ]

    @staticmethod
    def _checked(
        tensor: torch.Tensor, scale: float | None, defer_float32_check: bool = False
    ) -> tuple[DensePayload, Context]:
        check_float_tensor(tensor)
        if scale is not None:
            raise ValueError("IdentityCompressor has no scale; do not pass scale=")
        values = tensor.detach().contiguous()
        deferred = defer_float32_check and values.dtype == torch.float32 and not values.is_cuda
        if values.numel() and not deferred and not _all_finite(values):
            raise ValueError("tensor has NaN or Inf values")
        return DensePayload(values), Context(tuple(values.shape), values.dtype)


def _all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite (:func:`all_finite_array` on the CPU for float32 and
    float64; ``aminmax`` otherwise: NaN propagates through both)."""
    flat = values.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64):
        return all_finite_array(flat.numpy())
    low, high = torch.aminmax(flat)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))
