"""The uncompressed baseline: values are sent as they are."""

from __future__ import annotations

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
        check_float_tensor(tensor)
        if scale is not None:
            raise ValueError("IdentityCompressor has no scale; do not pass scale=")
        values = tensor.detach().contiguous().clone()
        if not bool(torch.isfinite(values).all()):
            raise ValueError("tensor has NaN or Inf values")
        return DensePayload(values), Context(tuple(values.shape), values.dtype)
