"""A Grid wrapper that polls for replies every 50 ms instead of every 3 s.

In a Flower 1.42 deployment the ServerApp's ``HttpGrid.send_and_receive``
pushes the messages and then sleeps a fixed 3 s between pulls for the
replies: on average 1.5 s (up to 3 s) of dead time per message round trip,
and a train + evaluate round has two of them. The interval is hard-coded, but
``push_messages`` / ``pull_messages`` are public API, so a ServerApp can wrap
its grid and do the same loop with a short interval::

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        grid = FastPollGrid(grid)          # everything else unchanged
        strategy.start(grid=grid, ...)

A pull is one small HTTP request to the SuperLink on the same machine, so
20 pulls/s cost little; raise ``poll_interval_s`` for very large federations.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

__all__ = ["DEFAULT_POLL_INTERVAL_S", "FastPollGrid"]

DEFAULT_POLL_INTERVAL_S = 0.05


class FastPollGrid(Grid):
    """Delegate everything to ``inner`` but poll replies every ``poll_interval_s``.

    Parameters
    ----------
    inner : Grid
        The grid Flower passed to the ServerApp.
    poll_interval_s : float
        Seconds between two ``pull_messages`` calls while replies are missing.
    """

    def __init__(self, inner: Grid, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S) -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.inner = inner
        self.poll_interval_s = float(poll_interval_s)

    def set_run(self, run: Run) -> None:
        """Delegate to the wrapped grid."""
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        """The run of the wrapped grid."""
        return self.inner.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Delegate to the wrapped grid."""
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """Delegate to the wrapped grid."""
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Delegate to the wrapped grid."""
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Delegate to the wrapped grid."""
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages``, then pull replies every ``poll_interval_s`` until all arrived.

        Same contract as ``Grid.send_and_receive``: returns the replies received
        before ``timeout`` seconds (``None``: wait for all of them).
        """
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            received = list(self.pull_messages(pending))
            replies.extend(received)
            pending.difference_update(m.metadata.reply_to_message_id for m in received)
            if not pending:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(self.poll_interval_s)
        return replies
