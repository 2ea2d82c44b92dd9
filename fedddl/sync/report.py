"""What happened in one round on the server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fedddl.sync.errors import ReplyError

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
    errors : dict[int, ReplyError]
        The same nodes, with the error that dropped them.
    clipped : dict[int, str]
        Nodes whose reply was aggregated with a tensor's scale clipped to the round's bound
        (:mod:`fedddl.sync.scale_bound`), with the reason.
    replicas_equal : bool | None
        Whether every checked fingerprint matched the shadow replica (None: none checked).
    checked : list[int]
        Nodes whose fingerprint was compared with the shadow replica's.
    mismatched : list[int]
        Those of them whose fingerprint differed.
    resync_limited : list[int]
        Nodes whose resync was held back this round (:mod:`fedddl.sync.resync_limit`).
    downlink_format : str
        ``"encoded"``, ``"shared-scale-sum"`` or ``"none"`` (no update this round).
    loss : float
        Mean training loss of the accepted replies.
    aggregate_s : float
        Seconds spent aggregating.
    skipped : bool
        Whether the round applied no update (no valid reply, fewer than ``min_replies``, or
        an aggregate that could not be combined, encoded or applied).
    skip_reason : str
        Why the round was skipped ('' when it was not).
    """

    server_round: int
    version: int = 0
    accepted: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    errors: dict[int, ReplyError] = field(default_factory=dict)
    clipped: dict[int, str] = field(default_factory=dict)
    replicas_equal: bool | None = None
    checked: list[int] = field(default_factory=list)
    mismatched: list[int] = field(default_factory=list)
    resync_limited: list[int] = field(default_factory=list)
    downlink_format: str = "none"
    loss: float = math.nan
    aggregate_s: float = 0.0
    skipped: bool = False
    skip_reason: str = ""

    def note_fingerprint_checked(self, node: int | None = None, *, mismatch: bool = False) -> None:
        """Record one fingerprint comparison (a mismatch makes ``replicas_equal`` false)."""
        self.replicas_equal = (self.replicas_equal is not False) and not mismatch
        if node is not None:
            self.checked.append(node)
            if mismatch:
                self.mismatched.append(node)

    def replicas_equal_without(self, nodes: set[int]) -> bool | None:
        """``replicas_equal`` over the fingerprints of every node except ``nodes``.

        None when no other node's fingerprint was checked.
        """
        others = [n for n in self.checked if n not in nodes]
        if not others:
            return None
        return not any(n in self.mismatched for n in others)
