"""``TernaryDelta``'s error feedback: ``"auto"`` (unless the strategy does not average) and its
window of rounds (:class:`FeedbackWindow`).

Error feedback keeps what a client's delta could not carry and adds it to its next reply;
that is right on average only if the aggregate counts every reply linearly (a weighted
mean). A coordinate-wise median or a trimmed mean keeps one or a few replies' values per
coordinate, so the carried-over residual mostly never reaches the model and only adds noise
to the replies: on Flower's quickstart CNN, FedMedian with the five-level uplink ended 1.3
points below plain at round 50 with error feedback and 0.3 above without it, FedTrimmedAvg
0.8 below and level (docs/results/dropin-accuracy.md, eighth round). Krum, MultiKrum and
Bulyan select or trim replies the same way (not measured on the CNN).

Where it is on, it applies to rounds 1-20 by default (``feedback_until_round``): it speeds the
first rounds and keeps the grid's count messages small, but kept to the end it left FedAvg
0.8 point behind plain at round 50 (ninth round of the same page).
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, MultiKrum, Strategy

__all__ = ["NOT_AVERAGING", "FeedbackWindow", "resolve_error_feedback"]

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


@dataclass(frozen=True)
class FeedbackWindow:
    """Whether the uplink's error feedback applies to a round's replies.

    ``on`` (resolved, with ``why``), after the first ``warmup_rounds`` rounds and up to round
    ``until_round`` (0: no end).

    Raises
    ------
    ValueError
        On a negative count, or when ``on`` and no round would get error feedback.
    """

    on: bool
    why: str = "set"
    warmup_rounds: int = 0
    until_round: int = 0

    def __post_init__(self) -> None:
        if self.warmup_rounds < 0:
            raise ValueError(f"feedback_warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if self.until_round < 0:
            raise ValueError(f"feedback_until_round must be >= 0, got {self.until_round}")
        if self.on and self.until_round and self.until_round <= self.warmup_rounds:
            raise ValueError(
                f"feedback_until_round={self.until_round} is not after feedback_warmup_rounds="
                f"{self.warmup_rounds}: error feedback would apply to no round (0: to the end)"
            )

    def applies(self, server_round: int) -> bool:
        """Whether ``server_round``'s replies are sent with error feedback."""
        last = self.until_round or server_round
        return self.on and self.warmup_rounds < server_round <= last

    def __str__(self) -> str:
        """E.g. ``True (auto), rounds 1-20`` or ``False (set)``."""
        if not self.on:
            return f"False ({self.why})"
        return f"True ({self.why}), rounds {self.warmup_rounds + 1}-{self.until_round or 'end'}"
