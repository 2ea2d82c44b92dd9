"""Frames that reach a gossip node before it trains: held, then admitted when training starts."""

from __future__ import annotations

import grpc

from fedddl.gossip.admission import RejectedFrame
from fedddl.gossip.wire import Frame

__all__ = ["NOT_READY", "HeldFrames"]

#: Reason text of a frame that cannot be held before training starts; senders retry it.
NOT_READY = "node is not ready yet"


class HeldFrames:
    """At most ``limit`` frames, one model-carrying and one other frame per sender.

    A newer state frame replaces the sender's held one; a second model frame from a sender,
    or any frame from a new sender once ``limit`` are held, is refused with
    :data:`NOT_READY` (the sender retries). Not thread-safe: the node calls it under its
    state lock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._frames: list[tuple[Frame, int]] = []

    def hold(self, frame: Frame, num_bytes: int) -> None:
        """Hold ``frame`` (of ``num_bytes`` on the wire).

        Raises
        ------
        RejectedFrame
            ``UNAVAILABLE`` with :data:`NOT_READY` when it cannot be held.
        """
        carries = frame.kind.carries_model
        same = [
            i for i, (held, _) in enumerate(self._frames)
            if held.sender == frame.sender and held.kind.carries_model == carries
        ]
        full = not same and len(self._frames) >= self.limit
        if (carries and same) or full:
            raise RejectedFrame(
                grpc.StatusCode.UNAVAILABLE,
                f"{NOT_READY}: training has not started (retry)",
                "not-ready",
                frame.sender,
            )
        if same:  # a newer state replaces the held one
            self._frames[same[0]] = (frame, num_bytes)
        else:
            self._frames.append((frame, num_bytes))

    def take(self) -> list[tuple[Frame, int]]:
        """The held frames in arrival order (replacements keep their slot); empties the hold."""
        frames, self._frames = self._frames, []
        return frames
