"""``TernaryDelta(downlink="grid")``: one count message a node, on the inline engine.

Checked: every node's model equals the server's broadcast bit for bit after catch-ups of
any length (sampled clients); a node beyond the log and a new node get the counts from the
all-zero model, far smaller than the fp32 model; a node that lies about its version is
refused and resynced at most once a resync window; an aggregate that is not finite is not
adopted; nodes without the mod and non-float arrays work as with the delta downlink; the
settings are checked.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedddl.flower import TernaryDelta, ternary_mod
from fedddl.flower.delta_grid_mod import STATE_GRID, STATE_GRID_LAYOUT
from fedddl.flower.delta_grid_protocol import COUNTS_KEY, GRID
from fedddl.flower.delta_protocol import META, digest, split_model
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.records import array_to_bytes, unpack_tensors
from fedddl.sync.grid_holder import load_state

NODES = 6
#: The labelling rule of every client's data: honest clients share a task, so their
#: updates share a direction (which the wrapper's direction check relies on).
_TEACHER = torch.randn(16, 3, generator=torch.Generator().manual_seed(7))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))


def _app(mods: list[Any]) -> ClientApp:
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        net = _net()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        node = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])  # type: ignore[index, arg-type]
        g = torch.Generator().manual_seed(100 * rnd + node)
        x = torch.randn(32, 16, generator=g)
        y = (x @ _TEACHER).argmax(dim=1)  # one task shared by every client
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        content = RecordDict(
            {
                "arrays": ArrayRecord(net.state_dict()),
                "metrics": MetricRecord({"loss": float(loss.detach()), "num-examples": 32}),
            }
        )
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        metrics = MetricRecord({"acc": 0.5, "num-examples": 1})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def _fedavg(fraction: float = 1.0, evaluate: float = 0.0) -> FedAvg:
    return FedAvg(
        fraction_train=fraction,
        fraction_evaluate=evaluate,
        min_train_nodes=1,
        min_evaluate_nodes=0,
        min_available_nodes=NODES,
    )


def _run(grid: InlineGrid, strategy: TernaryDelta, rounds: int) -> Any:
    random.seed(0)  # Flower's node sampling: the same nodes every run
    return strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=rounds,
        train_config=ConfigRecord({}),
        evaluate_fn=lambda rnd, arrays: MetricRecord({"ok": 1}),
    )


def _spy(grid: InlineGrid) -> list[dict[str, Any]]:
    """Per message sent: node, round, base and bytes of the grid counts (at send time)."""
    sent: list[dict[str, Any]] = []
    original = grid.send_and_receive

    def send_and_receive(messages: Any, *, timeout: float | None = None) -> Any:
        messages = list(messages)
        for m in messages:
            meta, counts = m.content.get(META), m.content.get(GRID)
            sent.append(
                {
                    "node": m.metadata.dst_node_id,
                    "round": int(m.content["config"]["server-round"]),  # type: ignore[index, arg-type]
                    "base": None if meta is None else meta["base"],  # type: ignore[index]
                    "version": None if meta is None else meta["version"],  # type: ignore[index]
                    "digest": None if meta is None else meta["digest"],  # type: ignore[index]
                    "arrays": list(m.content["arrays"].keys()),  # type: ignore[union-attr]
                    "counts": None
                    if counts is None
                    else len(array_to_bytes(counts[COUNTS_KEY])),  # type: ignore[index, arg-type]
                }
            )
        return original(messages, timeout=timeout)

    grid.send_and_receive = send_and_receive  # type: ignore[method-assign]
    return sent


def _held(context: Context) -> tuple[dict[str, torch.Tensor], int]:
    """The model a node keeps (float32; the test model is float32) and its version."""
    record, layout = context.state[STATE_GRID], context.state[STATE_GRID_LAYOUT]
    anchors = unpack_tensors(record["anchors"], layout)  # type: ignore[index, arg-type]
    state, version = load_state(anchors, array_to_bytes(record["counts"]))  # type: ignore[index, arg-type]
    return state.values(), version


def _fp32_bytes() -> int:
    return sum(4 * t.numel() for t in _net().state_dict().values() if t.is_floating_point())


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_sampled_clients_hold_the_broadcast_model_bit_for_bit() -> None:
    grid = InlineGrid(_app([ternary_mod]), NODES)
    sent = _spy(grid)
    strategy = TernaryDelta(
        _fedavg(fraction=0.34), downlink="grid", assume_mod=True, scale_bound=0
    )
    result = _run(grid, strategy, rounds=10)
    assert result.arrays is not None and strategy.dropped == {} and not strategy.skipped
    digests = {m["version"]: m["digest"] for m in sent}  # the server's, per version
    server = split_model(strategy.broadcast_model()).floats  # type: ignore[arg-type]
    contexts = [c for c in grid.contexts.values() if STATE_GRID in c.state]
    assert len(contexts) >= NODES - 1
    for context in contexts:
        held, version = _held(context)
        # from version 2 on the integer buffer is a float64 array (FedAvg's average)
        dtypes = {n: server[n].dtype if version >= 2 else torch.float32 for n in held}
        assert digest({n: t.to(dtypes[n]) for n, t in held.items()}) == digests[version]
    last = [_held(c) for c in contexts if _held(c)[1] == strategy.version]
    assert last and all(torch.equal(h[n].to(server[n].dtype), server[n]) for h, _ in last
                        for n in server)  # fmt: skip
    # catch-ups over several versions happened, each one message from the version held
    late = [m for m in sent if m["round"] > 1 and m["base"] is not None and m["base"] >= 1]
    assert any(m["version"] - m["base"] > 2 for m in late)
    assert all(m["counts"] is not None for m in sent)
    # the traffic metrics count every count message as compressed, its GRID record's bytes sent
    traffic = strategy.traffic
    assert traffic.down_plain == 0 and traffic.down_compressed == len(sent)
    assert traffic.down_bytes > 0 and traffic.down_saved > 3 * traffic.down_bytes
    # the broadcast model trails the exact FedAvg model by the grid's rounding only
    exact = split_model(result.arrays).floats
    gap = torch.cat([(exact[n] - server[n]).reshape(-1).float() for n in exact])
    whole = torch.cat([t.reshape(-1).float() for t in exact.values()])
    assert 0 < float(gap.norm()) <= 0.2 * float(whole.norm()), float(gap.norm() / whole.norm())


def test_a_node_beyond_the_log_and_a_new_node_get_counts_not_fp32() -> None:
    grid = InlineGrid(_app([ternary_mod]), NODES)
    sent = _spy(grid)
    strategy = TernaryDelta(
        _fedavg(fraction=0.34), downlink="grid", grid_log_size=1, assume_mod=True
    )
    _run(grid, strategy, rounds=8)
    fp32 = _fp32_bytes()
    first = [m for m in sent if m["round"] == 1]
    assert first and all(m["base"] == 0 for m in first)  # new nodes: counts from zero
    # round 2 is a new layout (FedAvg averages the integer buffer into float64)
    beyond = [m for m in sent if m["round"] > 2 and m["base"] == 0]
    assert beyond  # nodes further behind than the log
    assert all(m["counts"] < fp32 / 2 for m in first + beyond), (fp32, first + beyond)
    caught_up = [m for m in sent if m["base"] is not None and m["base"] >= 1]
    assert caught_up and all(m["version"] - m["base"] == 1 for m in caught_up)


def test_by_default_a_node_gets_the_whole_model_until_it_shows_the_mod() -> None:
    grid = InlineGrid(_app([ternary_mod]), NODES)
    sent = _spy(grid)
    strategy = TernaryDelta(_fedavg(fraction=0.5), downlink="grid", scale_bound=0)
    _run(grid, strategy, rounds=6)
    assert strategy.dropped == {}
    later = 0
    for node in grid.contexts:
        mine = [m for m in sent if m["node"] == node]
        assert mine and mine[0]["base"] == -1 and mine[0]["counts"] is None  # whole model
        assert all(m["counts"] is not None for m in mine[1:])  # then grid messages
        if len(mine) > 1 and mine[0]["round"] >= 2:  # (round 2 is a new layout)
            # the whole model came with the grid's units: the node rebuilt the grid state
            assert mine[1]["base"] == mine[0]["version"]
            later += 1
    assert later


def _lie(victim: int) -> Any:
    def tamper(message: Message, reply: Message) -> Message:
        if message.metadata.dst_node_id == victim and not reply.has_error():
            reply.content[META]["version"] = 0  # type: ignore[index]
        return reply

    return tamper


def test_a_lying_node_is_refused_and_resynced_once_a_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    victim, rounds, interval = 1001, 12, 4
    grid = InlineGrid(_app([ternary_mod]), NODES, tamper=_lie(victim))
    sent = _spy(grid)
    strategy = TernaryDelta(_fedavg(), downlink="grid", resync_interval=interval)
    with caplog.at_level(logging.WARNING):
        result = _run(grid, strategy, rounds=rounds)
    assert result.arrays is not None
    assert strategy.dropped.get("VersionMismatch") == rounds  # every reply refused
    to_victim = [m for m in sent if m["node"] == victim and m["round"] > 1]
    resyncs = [m["round"] for m in to_victim if m["base"] < m["version"] - 1]
    # served at once, then held back for the window, which doubles while it keeps lying
    assert resyncs == [2, 2 + interval], resyncs
    held_back = [m for m in to_victim if m["round"] not in resyncs]
    assert held_back and all(m["base"] == m["version"] - 1 for m in held_back)
    assert any("needs a resync again" in r.getMessage() for r in caplog.records)
    honest = [m for m in sent if m["node"] != victim and m["round"] > 2]  # 2: a new layout
    assert honest and all(m["base"] == m["version"] - 1 for m in honest)


def test_an_aggregate_that_is_not_finite_is_not_adopted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def huge(message: Message, reply: Message) -> Message:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        if message.metadata.dst_node_id == 1001 and rnd == 2 and not reply.has_error():
            for key in (META, "fedddl.ternary.delta"):
                del reply.content[key]
            state = {k: torch.full_like(v, 3e38) if v.is_floating_point() else v
                     for k, v in _net().state_dict().items()}  # fmt: skip
            reply.content["arrays"] = ArrayRecord(state)
        return reply

    grid = InlineGrid(_app([ternary_mod]), NODES, tamper=huge)
    strategy = TernaryDelta(_fedavg(), downlink="grid", scale_bound=0)
    with caplog.at_level(logging.WARNING):
        result = _run(grid, strategy, rounds=4)
    assert result.arrays is not None
    model = strategy.broadcast_model()
    assert model is not None
    assert all(bool(torch.isfinite(t).all()) for t in split_model(model).floats.values())
    messages = [r.getMessage() for r in caplog.records]
    assert strategy.skipped or any("keeps the broadcast model" in m for m in messages), messages


def test_plain_nodes_and_non_float_arrays_pass() -> None:
    grid = InlineGrid(_app([]), NODES)
    sent = _spy(grid)
    strategy = TernaryDelta(_fedavg(), downlink="grid")
    result = _run(grid, strategy, rounds=2)
    assert result.arrays is not None and strategy.dropped == {}
    assert all(m["base"] is None for m in sent if m["round"] == 2)
    # the integer buffer travels exact beside the grid in round 1 (from round 2 on FedAvg
    # has made it a float64 array, on the grid like the others)
    grid = InlineGrid(_app([ternary_mod]), NODES)
    sent = _spy(grid)
    strategy = TernaryDelta(_fedavg(), downlink="grid", assume_mod=True)
    result = _run(grid, strategy, rounds=2)
    assert result.arrays is not None and strategy.dropped == {}
    assert all(m["arrays"] == ["1.num_batches_tracked"] for m in sent if m["round"] == 1)
    assert all(m["arrays"] == [] for m in sent if m["round"] == 2)
    assert round(float(result.arrays["1.num_batches_tracked"].numpy())) == 2


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"downlink": "nope"}, "downlink must be"),
        ({"downlink": "grid", "grid_levels": 0}, "grid_levels"),
        ({"downlink": "grid", "grid_levels": 128}, "grid_levels"),
        ({"downlink": "grid", "grid_log_size": 0}, "grid_log_size"),
        ({"resync_interval": -1}, "resync_interval"),
    ],
)
def test_settings_are_checked(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TernaryDelta(_fedavg(), **settings)
