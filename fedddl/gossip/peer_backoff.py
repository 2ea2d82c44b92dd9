"""When a gossip node may send to each peer again, from the answers its sends got.

A send fails in one of five ways (:func:`failure_kind`): the peer has finished training
(never chosen again), is not ready yet (retry after 0.1 s, no failure), refused our model
frame as over its rate (wait one rate slot), has lost our compressed link (a key frame
next time, no wait), or anything else (exponential backoff from 0.25 s up to 5 s).
"""

from __future__ import annotations

import grpc

from fedddl.gossip.compressed import LINK_NO_BASE, LINK_OUT_OF_SYNC
from fedddl.gossip.held_frames import NOT_READY
from fedddl.gossip.transport import TransportError

__all__ = ["FINISHED", "FailureKind", "PeerBackoff", "failure_kind"]

#: Reason text of a model frame sent to a node that has finished training.
FINISHED = "node has finished training"
_NOT_READY_RETRY_S = 0.1
_MAX_BACKOFF_S = 5.0

FailureKind = str  # "finished" | "not-ready" | "rate-limited" | "out-of-sync" | "failed"


def failure_kind(exc: Exception) -> FailureKind:
    """Which of the five kinds of failed send ``exc`` is."""
    code = exc.code if isinstance(exc, TransportError) else None
    text = str(exc)
    if code is grpc.StatusCode.UNAVAILABLE and FINISHED in text:
        return "finished"
    if code is grpc.StatusCode.UNAVAILABLE and NOT_READY in text:
        return "not-ready"
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in text:
        return "rate-limited"
    if code is grpc.StatusCode.FAILED_PRECONDITION and (
        LINK_OUT_OF_SYNC in text or LINK_NO_BASE in text
    ):
        return "out-of-sync"
    return "failed"


class PeerBackoff:
    """Per peer: the time before which it is not sent to, its failures in a row, finished.

    Parameters
    ----------
    max_model_rate : float
        The peers' model frames per second limit (a rate-limited send waits ``1 / rate``).

    Not thread-safe: the node calls it under its state lock. Times are ``time.monotonic()``.
    """

    def __init__(self, max_model_rate: float) -> None:
        self._rate_gap_s = 1.0 / max_model_rate
        self._until: dict[int, float] = {}
        self._failures: dict[int, int] = {}
        self._finished: set[int] = set()

    def ready(self, peer: int, now: float) -> bool:
        """Whether ``peer``'s backoff has passed (state frames go to finished peers too)."""
        return self._until.get(peer, 0.0) <= now

    def choosable(self, peer: int, now: float) -> bool:
        """Whether a model may be shipped to ``peer`` now: ready and not finished."""
        return self.ready(peer, now) and peer not in self._finished

    def succeeded(self, peer: int) -> None:
        """A send to ``peer`` was acknowledged: its failures and backoff are cleared."""
        self._failures[peer] = 0
        self._until.pop(peer, None)

    def failed(self, peer: int, kind: FailureKind, now: float) -> float:
        """Record a failed send of ``kind``; returns the seconds ``peer`` is now backed off."""
        if kind == "finished":
            self._finished.add(peer)
            return 0.0
        if kind == "out-of-sync":
            return 0.0
        if kind == "not-ready":
            wait = _NOT_READY_RETRY_S
        elif kind == "rate-limited":
            wait = self._rate_gap_s
        else:
            failures = self._failures.get(peer, 0) + 1
            self._failures[peer] = failures
            wait = min(0.25 * 2 ** (failures - 1), _MAX_BACKOFF_S)
        self._until[peer] = now + wait
        return wait
