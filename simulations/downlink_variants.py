"""TernGrad with a changed downlink, for measuring what the downlink costs (not for use).

Pass as ``fedddl simulate --strategy simulations.downlink_variants:NAME``:

* :class:`TernGradExactDown` (with ``--downlink reternarize``): ternary uplink, the round's
  aggregate broadcast in fp32 (the ``identity`` encoding GradientAverage uses), so every
  replica takes the exact aggregate;
* :class:`TernGradGridNearest` (with ``--downlink grid``): the grid downlink with its codes
  rounded to the nearest integer instead of stochastically (error feedback kept).
"""

from __future__ import annotations

from typing import Any

from fedddl.sync import Aggregate
from fedddl.sync.grid_shadow import GridShadow
from strategies.terngrad import TernGrad

__all__ = ["TernGradExactDown", "TernGradGridNearest"]


class TernGradExactDown(TernGrad):
    """TernGrad whose broadcast aggregate travels in fp32."""

    def encode_downlink(self, server_round: int, aggregate: Aggregate) -> tuple[bytes, str]:
        """The aggregate in the ``identity`` encoding, its pooled statistics included."""
        return self.server.broadcast.encode(server_round, aggregate, "identity")


class TernGradGridNearest(TernGrad):
    """TernGrad on the grid downlink with round-to-nearest codes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.server.replica, GridShadow):
            self.server.replica.quantizer.stochastic = False
