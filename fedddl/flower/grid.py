"""Grid wrappers: one delegating base, a byte counter and a fast reply poller.

:class:`DelegatingGrid` forwards every :class:`~flwr.serverapp.Grid` method to the grid
it wraps; a wrapper overrides only what it changes:

* :class:`CountingGrid` counts the serialized bytes and messages each way and the time
  spent in ``send_and_receive`` (the figures of every results file).
* :class:`FastPollGrid` polls for replies every 50 ms instead of Flower 1.42's fixed 3 s
  (``HttpGrid.send_and_receive`` sleeps 3 s between pulls; ``push_messages`` /
  ``pull_messages`` are public API, so the same loop can run with a short interval)::

      @app.main()
      def main(grid: Grid, context: Context) -> None:
          grid = FastPollGrid(grid)          # everything else unchanged
          strategy.start(grid=grid, ...)

  A pull is one small request to the SuperLink, so 20 pulls/s cost little; raise
  ``poll_interval_s`` for very large federations.

Bytes are those of each message's content serialized as Flower's protobuf ``RecordDict``
(``recorddict_to_proto(content).ByteSize()``): what goes over the wire minus the fixed
per-message metadata. Messages that share one content object (a broadcast) are serialized
once and counted once per destination.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from flwr.app import Message, MetricRecord, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from fedddl.flower.protocol import CLIENT_CACHED, CLIENT_SECONDS, METRICS
from fedddl.flower.records import content_nbytes, record_of

__all__ = [
    "DEFAULT_POLL_INTERVAL_S",
    "SIMULATION_POLL_INTERVAL_S",
    "CountingGrid",
    "DelegatingGrid",
    "FastPollGrid",
    "fast_poll",
]

DEFAULT_POLL_INTERVAL_S = 0.05


class DelegatingGrid(Grid):
    """A :class:`~flwr.serverapp.Grid` that forwards every call to ``inner``."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner

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

    def get_nodes(self) -> Iterable[NodeInfo]:
        """Delegate to the wrapped grid."""
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Delegate to the wrapped grid."""
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Delegate to the wrapped grid."""
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Delegate to the wrapped grid."""
        return self.inner.send_and_receive(messages, timeout=timeout)


class CountingGrid(DelegatingGrid):
    """Count bytes, messages and time of the wrapped grid's exchanges.

    Attributes
    ----------
    bytes_down, bytes_up : int
        Serialized content bytes sent to / received from nodes since :meth:`reset`.
    messages_down, messages_up : int
        Message counts since :meth:`reset`.
    exchange_s : float
        Seconds spent inside the inner ``send_and_receive`` since :meth:`reset`.
    count_s : float
        Seconds spent serializing for the byte counts since :meth:`reset`.
    client_s : float
        Sum of the ``client-s`` metric of the replies (handler seconds reported by clients
        run with ``FEDDDL_CLIENT_TIMING=1``) since :meth:`reset`; finite values >= 0 only.
    client_cached_max : int | None
        Largest ``client-cached`` metric of the replies (same diagnostics) since
        :meth:`reset`.
    bytes_down_by_node, bytes_up_by_node : dict[int, int]
        The same byte counts per node since :meth:`reset`.
    """

    def __init__(self, inner: Grid) -> None:
        super().__init__(inner)
        self.reset()

    def reset(self) -> None:
        """Zero all counters."""
        self.bytes_down = 0
        self.bytes_up = 0
        self.messages_down = 0
        self.messages_up = 0
        self.exchange_s = 0.0
        self.count_s = 0.0
        self.client_s = 0.0
        self.client_cached_max: int | None = None
        self.bytes_down_by_node: dict[int, int] = {}
        self.bytes_up_by_node: dict[int, int] = {}

    def _count(self, contents: Iterable[tuple[int, RecordDict]], by_node: dict[int, int]) -> int:
        start = time.perf_counter()
        sizes: dict[int, int] = {}
        total = 0
        for node, content in contents:
            key = id(content)
            if key not in sizes:
                sizes[key] = content_nbytes(content)
            total += sizes[key]
            by_node[node] = by_node.get(node, 0) + sizes[key]
        self.count_s += time.perf_counter() - start
        return total

    def _count_down(self, messages: list[Message]) -> None:
        pairs = ((int(m.metadata.dst_node_id), m.content) for m in messages)
        self.bytes_down += self._count(pairs, self.bytes_down_by_node)
        self.messages_down += len(messages)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Count, then delegate."""
        messages = list(messages)
        self._count_down(messages)
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Delegate, then count the replies."""
        replies = list(self.inner.pull_messages(message_ids))
        self._observe(replies)
        return replies

    def _observe(self, replies: list[Message]) -> None:
        ok = [r for r in replies if not r.has_error()]
        pairs = ((int(r.metadata.src_node_id), r.content) for r in ok)
        self.bytes_up += self._count(pairs, self.bytes_up_by_node)
        self.messages_up += len(replies)
        for r in ok:
            metrics = record_of(r.content, METRICS, MetricRecord)
            value = None if metrics is None else metrics.get(CLIENT_SECONDS)
            if isinstance(value, float) and 0 <= value < math.inf:  # a client's claim
                self.client_s += value
            cached = None if metrics is None else metrics.get(CLIENT_CACHED)
            if isinstance(cached, int):
                self.client_cached_max = max(cached, self.client_cached_max or 0)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send ``messages``, wait for replies; count both directions."""
        messages = list(messages)
        if not messages:
            return []
        self._count_down(messages)
        start = time.perf_counter()
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        self.exchange_s += time.perf_counter() - start
        self._observe(replies)
        return replies


class FastPollGrid(DelegatingGrid):
    """Poll the wrapped grid for replies every ``poll_interval_s`` seconds.

    Parameters
    ----------
    inner : Grid
        The grid Flower passed to the ServerApp.
    poll_interval_s : float
        Seconds between two ``pull_messages`` calls while replies are missing (at most).
    wait : Callable[[float], None]
        Waits between two pulls, given ``poll_interval_s``: a plain sleep, or one that
        returns early when a reply arrives (the simulation's
        :meth:`fedddl.flower.message_pickup.PickupSession.wait_for_replies`).
    on_push : Callable[[], None] | None
        Called after each push (the simulation's
        :meth:`fedddl.flower.message_pickup.PickupSession.messages_pushed`).
    stopped : Callable[[], bool] | None
        True once no reply can come any more (the simulation returned): the wait for
        replies then raises ``RuntimeError`` instead of polling forever.
    """

    def __init__(
        self,
        inner: Grid,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        *,
        wait: Callable[[float], None] = time.sleep,
        on_push: Callable[[], None] | None = None,
        stopped: Callable[[], bool] | None = None,
    ) -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        super().__init__(inner)
        self.poll_interval_s = float(poll_interval_s)
        self.wait = wait
        self.on_push = on_push
        self.stopped = stopped

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push, then tell ``on_push`` (the simulation's pickup loop wakes at once)."""
        ids = self.inner.push_messages(messages)
        if self.on_push is not None:
            self.on_push()
        return ids

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages``, then pull replies every ``poll_interval_s`` until all arrived.

        Same contract as ``Grid.send_and_receive``: returns the replies received before
        ``timeout`` seconds (``None``: wait for all of them).
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
            if self.stopped is not None and self.stopped():
                raise RuntimeError(
                    f"the simulation ended while {len(pending)} replies were awaited"
                )
            self.wait(self.poll_interval_s)
        return replies


#: Longest wait between two reply pulls of the in-process simulation grid (Flower 1.42: a
#: fixed 0.1 s); inside ``fedddl simulate`` a stored reply ends the wait sooner.
SIMULATION_POLL_INTERVAL_S = 0.01


def fast_poll(grid: Grid) -> Grid:
    """Poll Flower's own grids for replies sooner; return other grids as given.

    A deployment ``HttpGrid`` (3 s between pulls) gets a :class:`FastPollGrid` at
    :data:`DEFAULT_POLL_INTERVAL_S`, and this process's pulls of reply objects that are
    still arriving retry within 0.2 s instead of 1-10 s (:mod:`fedddl.flower.object_pull`);
    the simulation's ``InMemoryGrid`` (0.1 s between pulls, so a round that needs 0.11 s
    of work takes 0.2 s) gets one at :data:`SIMULATION_POLL_INTERVAL_S` (a pull there is
    an in-memory lookup) that wakes the engine's pickup on each push and pulls as soon as
    a reply is stored, when the simulation runs inside
    :func:`fedddl.flower.message_pickup.quick_message_pickup`.
    Grids without push/pull (the inline engine's ``InlineGrid``) keep their own delivery.
    """
    try:
        from flwr.superlink.grid.http_grid import HttpGrid
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:  # another Flower layout: keep Flower's own polling
        return grid
    if isinstance(grid, HttpGrid):
        from fedddl.flower.object_pull import SERVERAPP, patch_object_pulls

        patch_object_pulls(SERVERAPP)  # reply objects still uploading: retry soon, not in 1 s
        return FastPollGrid(grid)
    if isinstance(grid, InMemoryGrid):
        from fedddl.flower.message_pickup import current_session

        session = current_session()
        if session is None:  # not inside fedddl simulate: plain polling
            return FastPollGrid(grid, SIMULATION_POLL_INTERVAL_S)
        return FastPollGrid(
            grid,
            SIMULATION_POLL_INTERVAL_S,
            wait=session.wait_for_replies,
            on_push=session.messages_pushed,
            stopped=session.is_closed,
        )
    return grid
