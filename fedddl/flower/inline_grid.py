"""The inline engine: a Ray-free :class:`~flwr.serverapp.Grid` that runs a ClientApp in-process.

:class:`InlineGrid` delivers each message of ``send_and_receive`` to the ClientApp at once,
node after node in the order sent, so replies come back in a fixed order and a run replays
exactly. Each node keeps its own ``context.state`` for the whole run and gets the
``node_config`` of Flower's simulation (``partition-id``, ``num-partitions``); node ids are
``1000 + partition-id``. A ClientApp that raises yields an error reply, as in Flower.
``push_messages`` / ``pull_messages`` are not supported.

:func:`run_inline` runs a ServerApp on an :class:`InlineGrid`: the engine behind
``fedddl simulate --engine inline``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["InlineGrid", "run_inline"]

#: Node id of the first node (``partition-id`` 0).
FIRST_NODE_ID = 1000


class InlineGrid(Grid):
    """Deliver every message to ``client_app`` synchronously, in the caller's process.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    num_nodes : int
        Nodes with ids ``1000 + partition-id``; all online (``online`` lists them).
    tamper : Callable[[Message, Message], Message] | None
        ``tamper(message, reply)`` returns the reply to hand back (fault injection).
    before : Callable[[Message, Context], None] | None
        Called with each message and its node's context before delivery.
    keep_sent : bool
        Keep every delivered message in ``sent`` (for inspection; grows with the run).
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        tamper: Callable[[Message, Message], Message] | None = None,
        before: Callable[[Message, Context], None] | None = None,
        *,
        keep_sent: bool = False,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        self.client_app = client_app
        self.tamper = tamper
        self.before = before
        self.keep_sent = keep_sent
        self.sent: list[Message] = []
        self.contexts: dict[int, Context] = {
            FIRST_NODE_ID + i: Context(
                run_id=1,
                node_id=FIRST_NODE_ID + i,
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
        """Run the ClientApp for each message in turn (offline nodes do not reply)."""
        replies: list[Message] = []
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in self.online:
                continue
            message.metadata.__dict__["_message_id"] = str(uuid4())
            message.metadata.__dict__["_src_node_id"] = 1
            if self.keep_sent:
                self.sent.append(message)
            if self.before is not None:
                self.before(message, self.contexts[node])
            try:
                reply = self.client_app(message, self.contexts[node])
            except Exception as err:
                reply = Message(
                    Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message
                )
            if self.tamper is not None:
                reply = self.tamper(message, reply)
            replies.append(reply)
        return replies


def run_inline(server_app: ServerApp, client_app: ClientApp, num_nodes: int) -> InlineGrid:
    """Run ``server_app`` to its end on an :class:`InlineGrid` of ``num_nodes`` nodes.

    The ServerApp gets an empty ``run_config`` (bind its configuration when building it).
    Returns the grid, whose ``contexts`` hold every node's final state.
    """
    grid = InlineGrid(client_app, num_nodes)
    server_context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    server_app(grid, server_context)
    return grid
