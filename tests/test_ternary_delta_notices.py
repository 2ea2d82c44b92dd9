"""No silent fallbacks in the drop-in layer: whatever travels plain is said, once per node
and reason, on both sides, and every exchange's traffic is in the metrics Flower keeps."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedddl.flower import TernaryDelta, ternary_mod
from fedddl.flower.delta_mod import STATE_SAID
from fedddl.flower.delta_protocol import META, UPDATES
from fedddl.flower.delta_traffic import Traffic, array_bytes
from fedddl.flower.inline_grid import InlineGrid
from tests.test_flower_ternary_delta import NODES, _client_app, _fedavg, _net, _run

ROUNDS = 3
KEYS = [f"fedddl.{way}.{what}" for way in ("down", "up")
        for what in ("compressed", "plain", "bytes", "bytes-saved")]  # fmt: skip


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _count_nodes(lines: list[str]) -> dict[int, int]:
    """How often each node is named in ``lines``."""
    named: dict[int, int] = {}
    for line in lines:
        for node in range(1000, 1000 + NODES):
            if str(node) in line:
                named[node] = named.get(node, 0) + 1
    return named


class _Bytes:
    """Array bytes of what the server sent (before the in-process mod rewrites it) and of
    the replies it got, per exchange."""

    def __init__(self, grid: InlineGrid) -> None:
        self.down: dict[tuple[int, str], int] = {}
        self.up: dict[tuple[int, str], int] = {}
        grid.before = self._before
        grid.tamper = self._after

    @staticmethod
    def _key(message: Message) -> tuple[int, str]:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        return rnd, message.metadata.message_type

    def _before(self, message: Message, context: Context) -> None:
        key = self._key(message)
        size = array_bytes(*message.content.array_records.values())
        self.down[key] = self.down.get(key, 0) + size

    def _after(self, message: Message, reply: Message) -> Message:
        if not reply.has_error():
            key = self._key(message)
            size = array_bytes(*reply.content.array_records.values())
            self.up[key] = self.up.get(key, 0) + size
        return reply


def test_every_exchange_reports_its_traffic_in_flowers_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid = InlineGrid(_client_app([ternary_mod]), NODES)
    wire = _Bytes(grid)
    strategy = TernaryDelta(_fedavg(fraction_evaluate=0.5))
    with caplog.at_level(logging.INFO):
        result, _ = _run(grid, strategy, rounds=ROUNDS)
    whole = array_bytes(ArrayRecord(_net().state_dict()))
    total = Traffic()
    for rnd in range(1, ROUNDS + 1):
        train = result.train_metrics_clientapp[rnd]
        evaluate = result.evaluate_metrics_clientapp[rnd]
        assert "loss" in train and "acc" in evaluate  # the wrapped strategy's metrics stay
        assert all(key in train and key in evaluate for key in KEYS)
        # the array bytes on the wire are the ones reported
        assert train["fedddl.down.bytes"] == wire.down[(rnd, "train")]
        assert train["fedddl.up.bytes"] == wire.up[(rnd, "train")]
        assert evaluate["fedddl.down.bytes"] == wire.down[(rnd, "evaluate")]
        assert evaluate["fedddl.up.compressed"] == evaluate["fedddl.up.plain"] == 0
        assert train["fedddl.up.compressed"] == NODES and train["fedddl.up.plain"] == 0
        assert evaluate["fedddl.down.compressed"] + evaluate["fedddl.down.plain"] == NODES // 2
        for metrics in (train, evaluate):
            total.add(Traffic(*(int(metrics[key]) for key in KEYS)))  # type: ignore[call-overload]
    first = result.train_metrics_clientapp[1]
    assert first["fedddl.down.plain"] == NODES and first["fedddl.down.compressed"] == 0
    # round 1 sends the initial model whole: nothing saved (its layout is the strategy's)
    assert first["fedddl.down.bytes"] == NODES * whole and first["fedddl.down.bytes-saved"] == 0
    # each reply saved what its model would have taken beyond the delta that was sent
    assert first["fedddl.up.bytes-saved"] == NODES * whole - first["fedddl.up.bytes"] > 0
    # (FedAvg turns the int64 BatchNorm counter into float64 in round 1: a new layout, sent
    # whole once more to each node; from round 3 on every message carries deltas)
    last = result.train_metrics_clientapp[ROUNDS]
    assert last["fedddl.down.compressed"] == NODES and last["fedddl.down.plain"] == 0
    assert last["fedddl.down.bytes-saved"] > 4 * last["fedddl.down.bytes"]
    assert total == strategy.traffic  # the run's totals are the sum of the exchanges
    # why round 1 was whole is said once per node, at INFO: first contact
    first_contact = _lines(caplog, "first message (no broadcast model yet)")
    assert _count_nodes(first_contact) == {n: 1 for n in range(1000, 1000 + NODES)}
    assert all(r.levelno == logging.INFO for r in caplog.records
               if "first message" in r.getMessage())  # fmt: skip


def test_clients_without_the_mod_are_named_once_and_counted_plain(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid = InlineGrid(_client_app([]), NODES)
    strategy = TernaryDelta(_fedavg())
    with caplog.at_level(logging.WARNING):
        result, _ = _run(grid, strategy, rounds=ROUNDS)
    lines = _lines(caplog, "runs no ternary_mod")
    assert _count_nodes(lines) == {n: 1 for n in range(1000, 1000 + NODES)}, lines
    for rnd in range(1, ROUNDS + 1):
        train = result.train_metrics_clientapp[rnd]
        assert train["fedddl.up.plain"] == NODES and train["fedddl.up.compressed"] == 0
        assert train["fedddl.up.bytes-saved"] == 0
    later = result.train_metrics_clientapp[ROUNDS]
    assert later["fedddl.down.plain"] == NODES and later["fedddl.down.bytes-saved"] == 0


def _int32_app() -> ClientApp:
    """The test app, replying its BatchNorm counter as int32 while the model is int64
    (round 1; FedAvg averages it into float64 afterwards, which the mod accepts)."""
    inner = _client_app([])
    app = ClientApp(mods=[ternary_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = inner(msg, context)
        record = reply.content["arrays"]
        assert isinstance(record, ArrayRecord)
        buffer = record["1.num_batches_tracked"]
        values = buffer.numpy()
        if values.dtype.kind == "i":
            record["1.num_batches_tracked"] = type(buffer)(values.astype("int32"))
        return reply

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return inner(msg, context)

    return app


def test_a_reply_the_mod_cannot_compress_is_said_on_both_sides(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid = InlineGrid(_int32_app(), NODES)
    strategy = TernaryDelta(_fedavg())
    with caplog.at_level(logging.WARNING):
        result, _ = _run(grid, strategy, rounds=ROUNDS)
    client = _lines(caplog, "reply sent uncompressed: no ArrayRecord of the reply")
    assert _count_nodes(client) == {n: 1 for n in range(1000, 1000 + NODES)}, client
    assert all("'1.num_batches_tracked' is int32[], the model's int64[]" in m for m in client)
    server = _lines(caplog, "sent its reply's arrays uncompressed")
    assert _count_nodes(server) == {n: 1 for n in range(1000, 1000 + NODES)}, server
    first = result.train_metrics_clientapp[1]
    assert first["fedddl.up.plain"] == NODES and first["fedddl.up.compressed"] == 0
    later = result.train_metrics_clientapp[ROUNDS]
    assert later["fedddl.up.compressed"] == NODES and later["fedddl.up.plain"] == 0
    assert strategy.dropped == {}  # a plain reply with the model's layout is admitted
    for context in grid.contexts.values():  # remembered with the node's state
        said = context.state[STATE_SAID]
        assert isinstance(said, ConfigRecord) and said["reasons"] == ["no-model"]


def test_the_mod_says_once_that_the_server_does_not_compress(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid = InlineGrid(_client_app([ternary_mod]), NODES)
    with caplog.at_level(logging.WARNING):
        result, _ = _run(grid, _fedavg(), rounds=ROUNDS)
    assert result.arrays is not None
    lines = _lines(caplog, "is not wrapped in TernaryDelta")
    assert _count_nodes(lines) == {n: 1 for n in range(1000, 1000 + NODES)}, lines
    assert all(r.name == "flwr" for r in caplog.records if "ternary_mod" in r.getMessage())


def test_a_node_whose_reply_failed_is_told_why_it_gets_the_whole_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def fail(message: Message, reply: Message) -> Message:
        rnd = message.content["config"]["server-round"]  # type: ignore[index]
        if message.metadata.dst_node_id == 1001 and rnd == 2:  # type: ignore[comparison-overlap]
            return Message(Error(code=0, reason="lost"), reply_to=message)
        return reply

    sent: list[tuple[int, int, bool]] = []
    grid = InlineGrid(_client_app([ternary_mod]), NODES, tamper=fail)

    def before(message: Message, context: Context) -> None:
        meta: Any = message.content.get(META)
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        sent.append((rnd, context.node_id, UPDATES in message.content or meta["base"] != -1))

    grid.before = before
    strategy = TernaryDelta(_fedavg(fraction_evaluate=0.0), downlink="delta")
    with caplog.at_level(logging.WARNING):
        _run(grid, strategy, rounds=ROUNDS)
    assert (3, 1001, False) in sent  # the whole model, after its empty reply
    lines = _lines(caplog, "got the whole model: its last reply failed or did not come")
    assert _count_nodes(lines) == {1001: 1}, lines


def test_a_message_whose_arrays_are_not_the_model_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class FirstLayerEval(FedAvg):
        """FedAvg whose evaluation messages carry only the first layer's weights."""

        def configure_evaluate(
            self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
        ) -> Iterable[Message]:
            part = ArrayRecord({"0.weight": arrays["0.weight"]})  # type: ignore[dict-item]
            return super().configure_evaluate(server_round, part, config, grid)

    inner = _client_app([])
    app = ClientApp(mods=[ternary_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return inner(msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        assert list(msg.content["arrays"].keys()) == ["0.weight"]  # type: ignore[union-attr]
        metrics = MetricRecord({"acc": 0.5, "num-examples": 1})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    grid = InlineGrid(app, NODES)
    strategy = TernaryDelta(FirstLayerEval(fraction_train=1.0, fraction_evaluate=1.0,
                                           min_available_nodes=NODES))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        result, _ = _run(grid, strategy, rounds=ROUNDS)
    assert len(result.evaluate_metrics_clientapp) == ROUNDS and strategy.dropped == {}
    server = _lines(caplog, "whose arrays are not the global model's layout")
    client = _lines(caplog, "carries arrays but no 'fedddl.ternary' record")
    everyone = {n: 1 for n in range(1000, 1000 + NODES)}
    assert _count_nodes(server) == everyone and _count_nodes(client) == everyone
