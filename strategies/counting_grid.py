"""A :class:`~flwr.serverapp.Grid` wrapper that counts serialized message bytes each way.

Bytes are those of each message's content serialized as Flower's protobuf
``RecordDict`` (``recorddict_to_proto(content).ByteSize()``): what goes over the
wire minus the fixed per-message metadata. Messages that share one content object
(a broadcast) are serialized once and counted once per destination.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from strategies.strategy_utils import content_nbytes

__all__ = ["CountingGrid"]


class CountingGrid(Grid):
    """Delegate everything to ``inner``, counting bytes and time of ``send_and_receive``.

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
        run with ``FEDDDL_CLIENT_TIMING=1``) since :meth:`reset`.
    """

    def __init__(self, inner: Grid) -> None:
        self.inner = inner
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

    def _count(self, contents: Iterable[RecordDict]) -> int:
        start = time.perf_counter()
        sizes: dict[int, int] = {}
        total = 0
        for content in contents:
            key = id(content)
            if key not in sizes:
                sizes[key] = content_nbytes(content)
            total += sizes[key]
        self.count_s += time.perf_counter() - start
        return total

    # ------------------------------------------------------------- delegation
    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:  # type: ignore[override]
        return self.inner.run  # type: ignore[no-any-return]

    def create_message(self, *args: object, **kwargs: object) -> Message:  # type: ignore[override]
        return self.inner.create_message(*args, **kwargs)  # type: ignore[arg-type]

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self.bytes_down += self._count(m.content for m in messages)
        self.messages_down += len(messages)
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        self._observe(replies)
        return replies

    def _observe(self, replies: list[Message]) -> None:
        ok = [r for r in replies if not r.has_error()]
        self.bytes_up += self._count(r.content for r in ok)
        self.messages_up += len(replies)
        for r in ok:
            metrics = r.content.metric_records.get("metrics")
            value = None if metrics is None else metrics.get("client-s")
            if isinstance(value, float):
                self.client_s += value

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send ``messages``, wait for replies; count both directions."""
        messages = list(messages)
        if not messages:
            return []
        self.bytes_down += self._count(m.content for m in messages)
        self.messages_down += len(messages)
        start = time.perf_counter()
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        self.exchange_s += time.perf_counter() - start
        self._observe(replies)
        return replies
