"""What ``downlink = "auto"`` (the default) means for a run.

TernGrad with clients sampled (``fraction-train`` < 1) gets the ``grid`` downlink: a client
that missed rounds catches up with one count-delta message instead of a log replay or an
fp32 snapshot. Every other run gets ``reternarize``: full participation (where the grid
costs a little accuracy and nobody falls behind), GradientAverage (the uncompressed
baseline keeps its fp32 downlink) and strategies named ``"module:Class"``. Server and
clients resolve it from the same run config, so they always agree.
"""

from __future__ import annotations

__all__ = ["AUTO", "GRID_BELOW_FRACTION", "GRID_STRATEGIES", "resolve_downlink"]

AUTO = "auto"
#: ``auto`` means ``grid`` when fewer than this fraction of the clients train a round.
GRID_BELOW_FRACTION = 1.0
#: The strategies whose ``auto`` downlink may be the grid.
GRID_STRATEGIES: tuple[str, ...] = ("terngrad",)


def resolve_downlink(downlink: str, *, strategy: str, fraction_train: float) -> str:
    """Return the downlink a run uses: ``downlink`` itself unless it is ``"auto"``, then
    ``"grid"`` for a strategy of :data:`GRID_STRATEGIES` at ``fraction_train`` below
    :data:`GRID_BELOW_FRACTION`, else ``"reternarize"``."""
    if downlink != AUTO:
        return downlink
    if strategy in GRID_STRATEGIES and fraction_train < GRID_BELOW_FRACTION:
        return "grid"
    return "reternarize"
