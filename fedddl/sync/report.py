"""What happened in one round on the server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["RoundReport"]


@dataclass
class RoundReport:
    """What happened in one round on the server.

    Attributes
    ----------
    server_round : int
        Global round number.
    version : int
        Shadow replica version after the round.
    accepted : list[int]
        Nodes whose gradients were aggregated (or, in a skipped round, the valid ones that
        were not applied).
    dropped : dict[int, str]
        Nodes left out, with the reason.
    replicas_equal : bool | None
        Whether every checked fingerprint matched the shadow replica (None: none checked).
    downlink_format : str
        ``"encoded"``, ``"shared-scale-sum"`` or ``"none"`` (no update this round).
    loss : float
        Mean training loss of the accepted replies.
    aggregate_s : float
        Seconds spent aggregating.
    skipped : bool
        Whether the round applied no update (no valid reply, or fewer than ``min_replies``).
    """

    server_round: int
    version: int = 0
    accepted: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    replicas_equal: bool | None = None
    downlink_format: str = "none"
    loss: float = math.nan
    aggregate_s: float = 0.0
    skipped: bool = False

    def note_fingerprint_checked(self, *, mismatch: bool = False) -> None:
        """Record one fingerprint comparison (a mismatch makes ``replicas_equal`` false)."""
        self.replicas_equal = (self.replicas_equal is not False) and not mismatch
