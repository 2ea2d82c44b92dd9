"""The gossip coordinator gives up on a node whose SuperNode is gone; the others finish.

The nodes are stand-in handlers on the Ray-free in-process grid: they answer the
coordinator's ops as a node's handler would, without peer processes, so the
coordinator's bookkeeping is tested alone (the real thing: tests/e2e).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedddl.flower.inline_grid import InlineGrid
from fedddl.gossip.peer_protocol import (
    ACTION,
    METRICS_RECORD,
    OP_HELLO,
    OP_START,
    OP_STATUS,
    OP_STOP,
    REPLY_RECORD,
    REQUEST_RECORD,
)
from strategies.gossip_coordinator import GossipConfig, GossipError, GossipResult, run_gossip

FINISH_AFTER_POLLS = 3


def _stand_in_nodes() -> tuple[ClientApp, Counter[tuple[int, str]]]:
    """A ClientApp whose gossip handler finishes after a few status polls."""
    seen: Counter[tuple[int, str]] = Counter()
    app = ClientApp()

    @app.query(ACTION)
    def handle(msg: Message, context: Context) -> Message:
        request = msg.content.config_records[REQUEST_RECORD]
        fields: dict[str, str | int] = {"status": "ok"}
        numbers: dict[str, int | float] = {}
        op = str(request["op"])
        if op == OP_HELLO:
            fields["pinned-id"] = int(context.node_config.get("gossip-id", -1))  # type: ignore[arg-type]
            content = RecordDict({REPLY_RECORD: ConfigRecord(fields)})
            return Message(content, reply_to=msg)
        gossip_id = int(request["gossip-id"])  # type: ignore[arg-type]
        seen[(gossip_id, op)] += 1
        if op == OP_START:
            fields["address"] = f"127.0.0.1:{7000 + gossip_id}"
        elif op in (OP_STATUS, OP_STOP):
            done = op == OP_STOP or seen[(gossip_id, OP_STATUS)] >= FINISH_AFTER_POLLS
            numbers = {"finished": int(done), "exited": int(op == OP_STOP), "alive": 1,
                       "steps": 10 if done else 5}
            fields["received-from"] = "{}"
        content = RecordDict({REPLY_RECORD: ConfigRecord(fields),
                              METRICS_RECORD: MetricRecord(numbers)})
        return Message(content, reply_to=msg)

    return app, seen


def _config() -> GossipConfig:
    return GossipConfig(num_nodes=3, poll_interval_s=0.01, status_timeout_s=1.0,
                        lost_after_polls=2, node_wait_s=5.0)


def _run(
    tamper: Callable[[Message, Message], Message],
) -> tuple[GossipResult, Counter[tuple[int, str]]]:
    app, seen = _stand_in_nodes()
    grid = InlineGrid(app, 3, tamper=tamper)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    return run_gossip(grid, context, _config()), seen


def test_a_node_whose_supernode_is_gone_is_lost_and_the_others_finish() -> None:
    def node_unavailable(message: Message, reply: Message) -> Message:
        request = message.content.config_records[REQUEST_RECORD]
        if request["op"] == OP_STATUS and request["gossip-id"] == 2:
            return Message(Error(code=0, reason="Node Unavailable"), reply_to=message)
        return reply

    result, seen = _run(node_unavailable)
    assert list(result.lost) == [2] and "Node Unavailable" in result.lost[2]
    assert sorted(result.metrics) == [0, 1]
    assert all(m["finished"] == 1 for m in result.metrics.values())
    assert seen[(2, OP_STATUS)] == 1 and seen[(2, OP_STOP)] == 0  # given up at once
    assert seen[(0, OP_STATUS)] == FINISH_AFTER_POLLS


def test_a_node_that_stops_answering_is_lost_after_some_polls() -> None:
    polls = Counter[int]()

    def go_silent(message: Message, context: Context) -> None:
        request = message.content.config_records[REQUEST_RECORD]
        if request["op"] == OP_STATUS and request["gossip-id"] == 2:
            polls[2] += 1
            if polls[2] == 2:  # it answers this poll, then never again
                grid.online.discard(context.node_id)

    app, seen = _stand_in_nodes()
    grid = InlineGrid(app, 3, before=go_silent)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    result = run_gossip(grid, context, _config())
    assert set(result.lost) == {2} and "no reply" in result.lost[2]
    assert sorted(result.metrics) == [0, 1]
    # It was waited for (lost_after_polls = 2 polls without a reply), not dropped at once.
    assert seen[(0, OP_STATUS)] == 2 + 2


def test_a_node_that_pins_its_gossip_id_gets_it() -> None:
    app, _ = _stand_in_nodes()
    grid = InlineGrid(app, 3)
    grid.contexts[1002].node_config["gossip-id"] = 0  # its certificate is gossip-node-0
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    result = run_gossip(grid, context, _config())
    assert result.flower_node_ids == {0: 1002, 1: 1000, 2: 1001}
    assert result.addresses == {g: f"127.0.0.1:{7000 + g}" for g in range(3)}

    grid = InlineGrid(app, 3)
    grid.contexts[1000].node_config["gossip-id"] = 1
    grid.contexts[1001].node_config["gossip-id"] = 1
    with pytest.raises(GossipError, match="pinned twice"):
        run_gossip(grid, context, _config())
