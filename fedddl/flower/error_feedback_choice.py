"""``TernaryDelta(error_feedback="auto")``: error feedback unless the strategy does not average.

Error feedback keeps what a client's delta could not carry and adds it to its next reply;
that is right on average only if the aggregate counts every reply linearly (a weighted
mean). A coordinate-wise median or a trimmed mean keeps one or a few replies' values per
coordinate, so the carried-over residual mostly never reaches the model and only adds noise
to the replies: on Flower's quickstart CNN, FedMedian with the five-level uplink ended 1.3
points below plain at round 50 with error feedback and 0.3 above without it, FedTrimmedAvg
0.8 below and level (docs/results/dropin-accuracy.md, eighth round). Krum, MultiKrum and
Bulyan select or trim replies the same way (not measured on the CNN).
"""

from __future__ import annotations

from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, MultiKrum, Strategy

__all__ = ["NOT_AVERAGING", "feedback_in_round", "resolve_error_feedback"]

#: Flower's strategies whose aggregate is not a weighted mean of every reply (Krum is a
#: MultiKrum).
NOT_AVERAGING: tuple[type[Strategy], ...] = (FedMedian, FedTrimmedAvg, MultiKrum, Bulyan)


def resolve_error_feedback(setting: bool | str, strategy: Strategy) -> tuple[bool, str]:
    """``(on, why)`` for ``TernaryDelta(error_feedback=setting)`` wrapping ``strategy``.

    ``True`` / ``False`` are kept; ``"auto"`` is off when ``strategy`` (or the strategy a
    wrapper holds as ``.strategy``, e.g. Flower's DP-clipping wrappers) is one of
    :data:`NOT_AVERAGING` or a subclass, on otherwise.

    Raises
    ------
    ValueError
        If ``setting`` is neither a bool nor ``"auto"``.
    """
    if isinstance(setting, bool):
        return setting, "set"
    if setting != "auto":
        raise ValueError(f"error_feedback must be True, False or 'auto', got {setting!r}")
    inner: object = strategy
    for _ in range(8):  # wrappers of wrappers, bounded
        if isinstance(inner, NOT_AVERAGING):
            return False, f"auto: {type(inner).__name__} does not average every reply"
        inner = getattr(inner, "strategy", None)
        if not isinstance(inner, Strategy):
            break
    return True, "auto"


def feedback_in_round(server_round: int, warmup_rounds: int, until_round: int) -> bool:
    """Whether error feedback (when on) applies to ``server_round``'s replies: after the
    ``warmup_rounds`` first rounds and up to ``until_round`` (0: no end)."""
    return server_round > warmup_rounds and (not until_round or server_round <= until_round)
