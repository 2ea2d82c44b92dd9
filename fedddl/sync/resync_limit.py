"""Rate limit on the resyncs a node causes (snapshots and multi-update catch-ups).

A node that asks to resync, reports another version than it was told to reach or a
fingerprint that differs from the shadow replica's needs more than the usual one-update
message: a replay of several logged updates or a snapshot. A client that does so every
round (buggy, or an attacker) would multiply the server's downlink. A reply the server
cannot even parse (bad metrics, an error) leaves its version unknown and counts the same.

:class:`ResyncLimiter` serves such a node's resyncs at most once every ``interval`` rounds;
in between it gets the message every up-to-date node gets (the latest update), which is all
an honest node at the previous version needs, and the server logs that it held the resync
back. A node that needs a resync again without having sent one valid reply since the last
one (it keeps failing, or lies) waits twice as long each time (at most 16 × ``interval``);
its first valid reply resets the wait.

Only resyncs the node caused are limited: a node that fell behind because the server did
not sample it, a node the server has never heard from and every node after a restore are
caught up at once.
"""

from __future__ import annotations

from logging import WARNING, getLogger

from fedddl.sync.errors import FingerprintMismatch, ReplyError, ResyncRequest, VersionMismatch

__all__ = ["ResyncLimiter"]

logger = getLogger("fedddl")

_CAUSES = (ResyncRequest, VersionMismatch, FingerprintMismatch)


class ResyncLimiter:
    """Serve each node's self-caused resyncs at most once every ``interval`` rounds.

    Parameters
    ----------
    interval : int
        Minimum rounds between two resyncs of one node (0 or 1: no limit).
    """

    #: The longest wait, in multiples of ``interval``.
    MAX_BACKOFF = 16

    def __init__(self, interval: int = 30) -> None:
        if interval < 0:
            raise ValueError(f"resync-interval must be >= 0, got {interval}")
        self.interval = interval
        self.needing: set[int] = set()
        self.last_served: dict[int, int] = {}
        self.strikes: dict[int, int] = {}
        self._warned: set[int] = set()

    def learn(self, node: int, error: ReplyError | None) -> None:
        """Note whether ``node``'s reply (dropped with ``error``, or accepted) needs a resync."""
        if error is None:
            self.needing.discard(node)
            self.strikes.pop(node, None)
        elif isinstance(error, _CAUSES):
            self.needing.add(node)

    def unreadable(self, node: int) -> None:
        """``node``'s reply could not be parsed: its version is unknown, it needs a resync."""
        self.needing.add(node)

    def wait(self, node: int) -> int:
        """Rounds ``node`` must wait after its last resync (doubling while it keeps failing)."""
        backoff: int = min(2 ** max(self.strikes.get(node, 0) - 1, 0), self.MAX_BACKOFF)
        return self.interval * backoff

    def holds_back(self, node: int, server_round: int) -> bool:
        """Whether a resync of ``node`` in ``server_round`` must wait (logged once per wait)."""
        if self.interval <= 1 or node not in self.needing:
            return False
        last = self.last_served.get(node)
        wait = self.wait(node)
        if last is None or server_round - last >= wait:
            return False
        if node not in self._warned:
            self._warned.add(node)
            logger.log(
                WARNING,
                "node %d needs a resync again %d round(s) after the last one; its resyncs "
                "are served at most once every %d rounds (next from round %d)",
                node,
                server_round - last,
                wait,
                last + wait,
            )
        return True

    def served(self, node: int, server_round: int) -> None:
        """``node`` gets a resync (snapshot or multi-update catch-up) in ``server_round``."""
        if node in self.needing:
            self.last_served[node] = server_round
            self.strikes[node] = self.strikes.get(node, 0) + 1
            self._warned.discard(node)

    def forget(self) -> None:
        """Forget everything (after a restore every node gets a snapshot anyway)."""
        self.needing.clear()
        self.last_served.clear()
        self.strikes.clear()
        self._warned.clear()
