"""``TernaryDelta(exact_rounds=n)``: replies travel plain in rounds 1 to n, compressed after.

In-process (InlineGrid), a tiny model, FedAvg. Checked: ``exact`` reaches the clients in
:data:`META` in exactly those rounds; those replies carry no delta and the others do; the
round's metrics count them as asked-for plain replies (``fedddl.up.exact``), none is
dropped; the clients' residual is cleared in an exact round; the wrapped strategy sees each
exact reply moved from the broadcast model onto the exact global model; off by default;
bad settings and a bad ``exact`` key are refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedddl.flower import TernaryDelta, ternary_mod
from fedddl.flower.delta_mod import STATE_RESIDUAL
from fedddl.flower.delta_protocol import DELTA, META, parse_broadcast
from fedddl.flower.inline_grid import InlineGrid
from tests.test_flower_ternary_delta import NODES, _client_app, _net


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


class _Seen(FedAvg):
    """FedAvg that keeps the models it is handed, with the wrapper's broadcast and exact
    model of that moment."""

    def __init__(self) -> None:
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=NODES)
        self.wrapper: TernaryDelta | None = None
        self.seen: dict[int, dict[int, dict[str, np.ndarray]]] = {}
        self.models: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}

    def aggregate_train(
        self, server_round: int, replies: Any
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.seen[server_round] = {
            r.metadata.src_node_id: {n: a.numpy().copy() for n, a in r.content["arrays"].items()}
            for r in replies
        }
        assert self.wrapper is not None
        broadcast = self.wrapper.broadcast
        self.models[server_round] = (dict(broadcast.floats), dict(broadcast.exact))
        return super().aggregate_train(server_round, replies)


def _run(rounds: int = 3, **options: Any) -> dict[str, Any]:
    exact: list[tuple[int, bool]] = []
    compressed: dict[tuple[int, int], bool] = {}
    sent: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    residual: list[tuple[int, bool]] = []

    def look(message: Message, context: Context) -> None:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        exact.append((rnd, parse_broadcast(message.content).exact))

    def count(message: Message, reply: Message) -> Message:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        node = reply.metadata.src_node_id
        compressed[rnd, node] = DELTA in reply.content
        if not compressed[rnd, node]:
            record = reply.content["arrays"]
            assert isinstance(record, ArrayRecord)
            sent[rnd, node] = {n: a.numpy().copy() for n, a in record.items()}
        return reply

    grid = InlineGrid(_client_app([ternary_mod]), NODES, before=look, tamper=count)
    inner = _Seen()
    strategy = TernaryDelta(inner, **options)
    inner.wrapper = strategy
    original = inner.aggregate_train

    def aggregate(server_round: int, replies: Any) -> Any:
        residual.extend(
            (server_round, STATE_RESIDUAL in c.state) for c in grid.contexts.values()
        )
        return original(server_round, replies)

    inner.aggregate_train = aggregate  # type: ignore[method-assign]
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=rounds,
        train_config=ConfigRecord({}),
    )
    assert strategy.dropped == {}
    return {"exact": exact, "compressed": compressed, "sent": sent, "residual": residual,
            "result": result, "inner": inner}  # fmt: skip


def test_round_one_replies_plain_and_round_two_compressed() -> None:
    run = _run(exact_rounds=1)
    assert set(run["exact"]) == {(1, True), (2, False), (3, False)}
    by_round: dict[int, set[bool]] = {}
    for (rnd, _), was in run["compressed"].items():
        by_round.setdefault(rnd, set()).add(was)
    assert by_round == {1: {False}, 2: {True}, 3: {True}}
    metrics = run["result"].train_metrics_clientapp
    assert metrics[1]["fedddl.up.exact"] == metrics[1]["fedddl.up.plain"] == NODES
    assert metrics[1]["fedddl.up.compressed"] == 0 and metrics[1]["fedddl.up.bytes-saved"] == 0
    for rnd in (2, 3):
        assert "fedddl.up.exact" not in metrics[rnd]
        assert metrics[rnd]["fedddl.up.compressed"] == NODES
        assert metrics[rnd]["fedddl.up.plain"] == 0
    # no residual after the exact round; error feedback keeps one from round 2 on
    assert {r for r, kept in run["residual"] if kept} == {2, 3}


def test_exact_replies_are_moved_onto_the_exact_global_model() -> None:
    run = _run(rounds=2, exact_rounds=2)
    inner: _Seen = run["inner"]
    held, exact = inner.models[2]
    assert any(not torch.equal(held[n], exact[n]) for n in held)  # the grid's broadcast lags
    for (rnd, node), client in run["sent"].items():
        got = inner.seen[rnd][node]
        held, exact = inner.models[rnd]
        for name, values in client.items():
            if name not in held:
                np.testing.assert_array_equal(got[name], values)
                continue
            want = exact[name].double() + (torch.from_numpy(values).double() - held[name].double())
            np.testing.assert_allclose(got[name], want.numpy(), rtol=0, atol=1e-6)
    assert not any(run["compressed"].values())


def test_off_by_default() -> None:
    run = _run(rounds=2)
    assert {e for _, e in run["exact"]} == {False}
    assert all(run["compressed"].values())


def test_settings_and_meta_are_checked() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="exact_rounds must be an int >= 0"):
            TernaryDelta(FedAvg(), exact_rounds=bad)  # type: ignore[arg-type]
    content = RecordDict({"arrays": ArrayRecord(_net().state_dict())})
    meta = ConfigRecord({
        "record": "arrays", "names": ["a"], "version": 1, "base": -1, "digest": "x",
        "compressor": "ternary-threshold-base3", "clip-sigma": 2.5, "error-feedback": True,
        "seed": 0, "exact": 1,
    })  # fmt: skip
    content[META] = meta
    with pytest.raises(ValueError, match="'exact' must be bool"):
        parse_broadcast(content)
    meta["exact"] = True
    assert parse_broadcast(content).exact
