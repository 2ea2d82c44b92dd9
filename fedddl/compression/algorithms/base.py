"""The compressor interface (GRACE-style: compress / decompress, no transport)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from fedddl.compression.algorithms.payload import Context, Payload, decompress_payload

__all__ = ["Compressor"]


class Compressor(ABC):
    """Turns a tensor into a payload and back; knows nothing about transport.

    Subclasses return a :class:`~fedddl.compression.DensePayload` or a
    :class:`~fedddl.compression.TernaryPayload` so that
    :func:`~fedddl.compression.encode_update` can serialise it.
    """

    #: Registry name of the compressor.
    name: str = "compressor"

    #: Capability: payloads are ternary codes times one scale per tensor (TernGrad-style).
    #: A ternary compressor's factory accepts the keyword arguments ``seed`` and
    #: ``clip_sigma`` (see :func:`~fedddl.compression.make_compressor`), its
    #: :meth:`compress` accepts ``scale=`` and :meth:`local_scale` returns its scaler, so it
    #: can take part in scaler sharing and in the ``shared-scale-sum`` downlink.
    #: A plug-in compressor opts in by setting it to ``True``.
    ternary: bool = False

    #: Capability: the factory accepts ``seed`` and ``clip_sigma`` (every ``ternary``
    #: compressor's does), so :func:`~fedddl.compression.make_compressor` passes them; one
    #: with neither is built with its factory's defaults.
    configurable: bool = False

    #: Entropy coding of the whole message by :func:`~fedddl.compression.encode_update`:
    #: ``""`` (none) or ``"zstd"`` (format in :mod:`fedddl.compression.codecs.entropy`).
    entropy_coding: str = ""

    @abstractmethod
    def compress(
        self, tensor: torch.Tensor, *, scale: float | None = None
    ) -> tuple[Payload, Context]:
        """Compress a floating ``tensor``; return its payload and the context to decompress it.

        ``scale`` is a shared scaler (see :meth:`local_scale`). Raises ``ValueError`` on
        non-finite values, or when ``scale`` is given to a compressor without a scale.
        """

    def compress_batch(
        self, tensors: Sequence[torch.Tensor], scales: Sequence[float | None] | None = None
    ) -> list[tuple[Payload, Context]]:
        """:meth:`compress` of several tensors, in order (what
        :func:`~fedddl.compression.encode_update` calls).

        Override it to share work between tensors; the result must equal
        calling :meth:`compress` on each tensor in order.
        """
        scales = [None] * len(tensors) if scales is None else list(scales)
        if len(scales) != len(tensors):
            raise ValueError(f"{len(scales)} scales for {len(tensors)} tensors")
        pairs = zip(tensors, scales, strict=True)
        return [self.compress(tensor, scale=scale) for tensor, scale in pairs]

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        """Rebuild a tensor of ``ctx.shape`` and ``ctx.dtype`` from ``payload``."""
        return decompress_payload(payload, ctx)

    def local_scale(self, tensor: torch.Tensor) -> float | None:
        """The scaler this compressor would use for ``tensor`` (``None``: no scaler).

        Workers can share ``max`` of their local scales and pass it to
        :meth:`compress` as ``scale`` (TernGrad's scaler sharing).
        """
        del tensor
        return None
