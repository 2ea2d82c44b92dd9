"""GradientAverage: the TernGrad protocol with fp32 gradients (the uncompressed baseline)."""

from __future__ import annotations

from strategies.terngrad import TernGrad

__all__ = ["GradientAverage"]


class GradientAverage(TernGrad):
    """Same localized-replica protocol as :class:`TernGrad`, but every gradient and every
    broadcast update travels as fp32 through the ``identity`` compressor."""

    def compressor_name(self) -> str:
        """Always ``"identity"`` (no compression either way)."""
        return "identity"
