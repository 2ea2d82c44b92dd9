"""A Ray-free :class:`~flwr.serverapp.Grid` running a ClientApp in-process, node after node.

For tests and debugging of strategies with real :class:`~flwr.app.Message` objects:
each node has its own persistent ``context.state`` and a ``node_config`` with
``partition-id`` / ``num-partitions``, as in Flower's simulation. A ClientApp that
raises produces an error reply, as Flower does. ``before`` (called with each message
and the node's context before delivery) and ``tamper`` (called with each message and
its reply) let tests inject faults.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["InlineGrid"]


class InlineGrid(Grid):
    """Deliver every message to ``client_app`` synchronously.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    num_nodes : int
        Nodes with ids ``1000 + partition-id``.
    tamper : Callable[[Message, Message], Message] | None
        ``tamper(message, reply)`` returns the reply to hand back (fault injection).
    before : Callable[[Message, Context], None] | None
        Called before each delivery (e.g. to wipe a node's state).
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        tamper: Callable[[Message, Message], Message] | None = None,
        before: Callable[[Message, Context], None] | None = None,
    ) -> None:
        self.client_app = client_app
        self.tamper = tamper
        self.before = before
        self.sent: list[Message] = []
        self.contexts: dict[int, Context] = {
            1000 + i: Context(
                run_id=1,
                node_id=1000 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self.online: set[int] = set(self.contexts)
        # Flower's Message constructor reads the process' task identity (set by the
        # runtime in real runs); give it one when running without a runtime.
        for attr in ("_run_id", "_task_id", "_node_id"):
            if getattr(TaskIdentity, attr) is None:
                setattr(TaskIdentity, attr, 1)
        self._run = Run.create_empty(run_id=1)
        self.client_s = 0.0

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:  # type: ignore[override]
        return self._run

    def create_message(  # type: ignore[override]
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.online)

    def get_nodes(self) -> Iterable[NodeInfo]:
        return [NodeInfo(node_id=n) for n in sorted(self.online)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("InlineGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("InlineGrid only supports send_and_receive")

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Run the ClientApp for each message (offline nodes do not reply)."""
        replies: list[Message] = []
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in self.online:
                continue
            message.metadata.__dict__["_message_id"] = str(uuid4())
            message.metadata.__dict__["_src_node_id"] = 1
            self.sent.append(message)
            if self.before is not None:
                self.before(message, self.contexts[node])
            start = time.perf_counter()
            try:
                reply = self.client_app(message, self.contexts[node])
            except Exception as err:
                reply = Message(
                    Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message
                )
            self.client_s += time.perf_counter() - start
            if self.tamper is not None:
                reply = self.tamper(message, reply)
            replies.append(reply)
        return replies
