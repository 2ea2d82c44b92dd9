"""Every stock Flower strategy wrapped in ``TernaryDelta``, in-process (InlineGrid).

For each: the run finishes, the final model is finite, the central loss falls, no reply
is dropped, and after round 1 every training message and reply carries the model
compressed (checked on the wire and in the wrapper's metrics). Strategies that return
another dtype than the clients send (FedAdam, QFedAvg: float64; float16 models) keep
compressing both ways; a dtype numpy does not know (bfloat16) travels exact.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import (
    Bulyan,
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
    QFedAvg,
    Result,
    Strategy,
)
from torch import nn

from fedddl.flower import TernaryDelta, ternary_mod
from fedddl.flower.delta_protocol import DELTA, META, UPDATES
from fedddl.flower.inline_grid import InlineGrid

NODES, ROUNDS, FEATURES, CLASSES = 6, 3, 16, 4
_TEACHER = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(7))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (x @ _TEACHER).argmax(1)


def _loss(net: nn.Module) -> float:
    x, y = _batch(999_999)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(net(x), y))


def _client_app(train_mods: Iterable[Any] = (), mods: Iterable[Any] = (ternary_mod,)) -> ClientApp:
    """Flower's quickstart shape: ``arrays`` + ``metrics`` (``train_loss`` for QFedAvg)."""
    app = ClientApp(mods=list(mods))

    @app.train(mods=list(train_mods))
    def train(msg: Message, context: Context) -> Message:
        net = _net()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        node = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])  # type: ignore[index, arg-type]
        opt = torch.optim.SGD(net.parameters(), lr=0.2)
        for step in range(3):
            x, y = _batch(1000 * node + 10 * rnd + step)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        metrics = MetricRecord({"train_loss": float(loss.detach()), "num-examples": 64})
        content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        net = _net()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        metrics = MetricRecord({"eval_loss": _loss(net), "num-examples": 64})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def _sampling() -> dict[str, Any]:
    return {"fraction_train": 1.0, "fraction_evaluate": 0.5, "min_available_nodes": NODES}


#: name -> (the strategy, the ClientApp's train mods after ``ternary_mod``).
STRATEGIES: dict[str, tuple[Callable[[], Strategy], tuple[Any, ...]]] = {
    "FedAvg": (lambda: FedAvg(**_sampling()), ()),
    "FedAvgM": (lambda: FedAvgM(**_sampling(), server_momentum=0.5), ()),
    "FedProx": (lambda: FedProx(**_sampling(), proximal_mu=0.1), ()),
    "FedAdagrad": (lambda: FedAdagrad(**_sampling(), eta=0.05), ()),
    "FedAdam": (lambda: FedAdam(**_sampling(), eta=0.05), ()),
    "FedYogi": (lambda: FedYogi(**_sampling(), eta=0.05), ()),
    "FedMedian": (lambda: FedMedian(**_sampling()), ()),
    "FedTrimmedAvg": (lambda: FedTrimmedAvg(**_sampling(), beta=0.2), ()),
    "Krum": (lambda: Krum(**_sampling(), num_malicious_nodes=1), ()),
    "MultiKrum": (
        lambda: MultiKrum(**_sampling(), num_malicious_nodes=1, num_nodes_to_select=3),
        (),
    ),
    "Bulyan": (lambda: Bulyan(**_sampling(), num_malicious_nodes=0), ()),
    "QFedAvg": (lambda: QFedAvg(client_learning_rate=0.2, **_sampling()), ()),
    "DPServerSideFixedClipping": (
        lambda: DifferentialPrivacyServerSideFixedClipping(FedAvg(**_sampling()), 0.01, 5.0, NODES),
        (),
    ),
    "DPClientSideFixedClipping": (
        lambda: DifferentialPrivacyClientSideFixedClipping(FedAvg(**_sampling()), 0.01, 5.0, NODES),
        (fixedclipping_mod,),
    ),
    "DPServerSideAdaptiveClipping": (
        lambda: DifferentialPrivacyServerSideAdaptiveClipping(
            FedAvg(**_sampling()), 0.01, NODES, initial_clipping_norm=5.0
        ),
        (),
    ),
    "DPClientSideAdaptiveClipping": (
        lambda: DifferentialPrivacyClientSideAdaptiveClipping(
            FedAvg(**_sampling()), 0.01, NODES, initial_clipping_norm=5.0
        ),
        (adaptiveclipping_mod,),
    ),
}


@pytest.fixture(autouse=True)
def _no_full_collections(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Flower's ``to_numpy_ndarrays(keep_input=False)`` (Bulyan, QFedAvg) runs a full
    ``gc.collect()`` per reply, 0.6 s each in a test process; nothing here needs it."""
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)
    yield


class _Wire:
    """What travelled, per (round, message type): messages that carried updates (seen
    before the mod consumed them) and replies that carried a delta."""

    def __init__(self, grid: InlineGrid) -> None:
        self.updates: dict[tuple[int, str], int] = {}
        self.messages: dict[tuple[int, str], int] = {}
        self.deltas: dict[tuple[int, str], int] = {}
        self.named_dtypes: set[bool] = set()  # whether compressed replies named dtypes
        self.errors = 0
        grid.before = self._before
        grid.tamper = self._after

    @staticmethod
    def _key(message: Message) -> tuple[int, str]:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        return rnd, message.metadata.message_type

    def _before(self, message: Message, context: Context) -> None:
        key = self._key(message)
        self.messages[key] = self.messages.get(key, 0) + 1
        meta = message.content.get(META)
        held = isinstance(meta, ConfigRecord) and meta["base"] != -1
        self.updates[key] = self.updates.get(key, 0) + int(UPDATES in message.content or held)

    def _after(self, message: Message, reply: Message) -> Message:
        if reply.has_error():
            self.errors += 1
        elif DELTA in reply.content:
            key = self._key(message)
            self.deltas[key] = self.deltas.get(key, 0) + 1
            self.named_dtypes.add("dtypes" in reply.content[META])  # type: ignore[operator]
        return reply


def _run(
    strategy: Strategy, grid: InlineGrid, initial: ArrayRecord, rounds: int = ROUNDS
) -> tuple[Result, list[float]]:
    losses: list[float] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = _net()
        net.load_state_dict(arrays.to_torch_state_dict())
        losses.append(_loss(net))
        return MetricRecord({"loss": losses[-1]})

    result = strategy.start(
        grid=grid, initial_arrays=initial, num_rounds=rounds, evaluate_fn=central
    )
    return result, losses


def _ratios(result: Result, after: int = 1) -> tuple[float, float]:
    """Model bytes as built / bytes sent, (up, down), over the rounds after ``after``."""
    totals = {"up": [0, 0], "down": [0, 0]}
    for records in (result.train_metrics_clientapp, result.evaluate_metrics_clientapp):
        for rnd, metrics in records.items():
            if rnd <= after:
                continue
            for way, (whole, sent) in totals.items():
                sent_now = int(metrics[f"fedddl.{way}.bytes"])  # type: ignore[call-overload]
                saved = int(metrics[f"fedddl.{way}.bytes-saved"])  # type: ignore[call-overload]
                totals[way] = [whole + sent_now + saved, sent + sent_now]
    return tuple(w / max(s, 1) for w, s in totals.values())  # type: ignore[return-value]


def _finite(arrays: ArrayRecord) -> bool:
    return all(bool(np.isfinite(a.numpy()).all()) for a in arrays.values())


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_stock_strategy_compresses_both_ways(name: str) -> None:
    make, train_mods = STRATEGIES[name]
    grid = InlineGrid(_client_app(train_mods), NODES)
    wire = _Wire(grid)
    strategy = TernaryDelta(make())
    result, losses = _run(strategy, grid, ArrayRecord(_net().state_dict()))

    assert set(result.train_metrics_clientapp) == set(range(1, ROUNDS + 1))  # it finished
    assert _finite(result.arrays) and wire.errors == 0 and strategy.dropped == {}
    assert losses[-1] < 0.9 * losses[0], losses  # it learns
    last = result.train_metrics_clientapp[ROUNDS]
    assert last["fedddl.down.compressed"] == NODES and last["fedddl.down.plain"] == 0
    assert last["fedddl.up.compressed"] == NODES and last["fedddl.up.plain"] == 0
    # on the wire: every training message of the last round carried updates (or none
    # were needed), every training reply of every round a delta
    assert wire.updates[(ROUNDS, "train")] == wire.messages[(ROUNDS, "train")] == NODES
    assert all(wire.deltas.get((r, "train")) == NODES for r in range(1, ROUNDS + 1))
    up, down = _ratios(result)
    assert up > 8 and down > 8, (up, down)
    print(f"{name}: up {up:.1f}x, down {down:.1f}x after round 1")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_loss_stays_near_the_uncompressed_runs(name: str) -> None:
    """The central loss after 3 rounds, compressed against uncompressed (same clients, same
    data): within 15 % (the adaptive server optimizers are the furthest)."""
    make, train_mods = STRATEGIES[name]
    losses = []
    for mods in ((), (ternary_mod,)):
        grid = InlineGrid(_client_app(train_mods, mods=mods), NODES)
        strategy = TernaryDelta(make()) if mods else make()
        losses.append(_run(strategy, grid, ArrayRecord(_net().state_dict()))[1])
    (start, *_, plain), (_, *_, compressed) = losses
    print(f"| {name} | {start:.3f} | {plain:.3f} | {compressed:.3f} |")
    assert compressed < 1.15 * plain, (plain, compressed)


class _Cast(FedAvg):
    """FedAvg whose global model is of ``dtype`` (a strategy returning another dtype)."""

    def __init__(self, dtype: str) -> None:
        super().__init__(**_sampling())
        self.dtype = dtype

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        return (None if arrays is None else _as(arrays, self.dtype)), metrics


def _as(arrays: ArrayRecord, dtype: str) -> ArrayRecord:
    return ArrayRecord({n: Array(a.numpy().astype(dtype)) for n, a in arrays.items()})  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_a_strategy_of_another_dtype_compresses_both_ways_from_round_1(dtype: str) -> None:
    """The model is ``dtype`` from the start: downlink deltas of ``dtype``; replies (the
    app sends float32) go up as float32 deltas and reach the strategy as float32."""
    seen: list[set[str]] = []

    class Spy(_Cast):
        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            replies = list(replies)
            seen.append({a.dtype for r in replies for a in r.content["arrays"].values()})  # type: ignore[union-attr]
            return super().aggregate_train(server_round, replies)

    grid = InlineGrid(_client_app(), NODES)
    wire = _Wire(grid)
    strategy = TernaryDelta(Spy(dtype))
    result, losses = _run(strategy, grid, _as(ArrayRecord(_net().state_dict()), dtype))
    assert {a.dtype for a in result.arrays.values()} == {dtype} and _finite(result.arrays)
    assert seen == [{"float32"}] * ROUNDS  # restored in the dtype the app sent
    assert wire.named_dtypes == {True}  # ... which the replies name
    assert losses[-1] < 0.9 * losses[0], losses
    for rnd in range(2, ROUNDS + 1):
        metrics = result.train_metrics_clientapp[rnd]
        assert metrics["fedddl.down.plain"] == 0 and metrics["fedddl.up.plain"] == 0
        assert wire.updates[(rnd, "train")] == NODES
    assert all(wire.deltas[(r, "train")] == NODES for r in range(1, ROUNDS + 1))
    assert strategy.traffic.down_plain == NODES  # round 1 only
    up, down = _ratios(result)
    assert up > 8 and down > 4, (up, down)


@pytest.mark.parametrize("downlink", ["grid", "delta"])
def test_fedadam_turning_float32_into_float64_keeps_compressing_both_ways(downlink: str) -> None:
    """FedAdam returns float64 from round 1 on: the clients keep the float32 broadcast
    model and receive float32 updates (grid counts or deltas, never a fresh start); every
    reply of every round goes up compressed and reaches FedAdam as the app sent it
    (float32)."""
    seen: list[set[str]] = []

    class Spy(FedAdam):
        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            replies = list(replies)
            seen.append({a.dtype for r in replies for a in r.content["arrays"].values()})  # type: ignore[union-attr]
            return super().aggregate_train(server_round, replies)

    grid = InlineGrid(_client_app(), NODES)
    wire = _Wire(grid)
    strategy = TernaryDelta(Spy(**_sampling(), eta=0.05), downlink=downlink)
    result, _ = _run(strategy, grid, ArrayRecord(_net().state_dict()), rounds=4)
    assert result.arrays["0.weight"].dtype == "float64" and seen == [{"float32"}] * 4
    assert wire.named_dtypes == {False}  # the replies' dtypes are the broadcast model's
    broadcast = strategy.broadcast_model()
    assert broadcast is not None and broadcast["0.weight"].dtype == "float32"
    assert all(wire.deltas[(r, "train")] == NODES for r in range(1, 5))
    assert strategy.traffic.up_plain == 0 and strategy.traffic.up_compressed == 4 * NODES
    assert strategy.traffic.down_plain == NODES  # first contact only
    assert all(wire.updates[(r, "train")] == NODES for r in range(2, 5))


def test_an_array_of_a_dtype_numpy_does_not_know_travels_exact() -> None:
    """A bfloat16 Array (raw bytes: numpy has no bfloat16) beside float32 ones: the float
    arrays are compressed both ways, the bfloat16 one travels as it is."""
    raw = torch.arange(6, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    odd = Array(dtype="bfloat16", shape=(6,), stype="raw", data=raw)

    class Echo(FedAvg):
        """FedAvg of the float arrays; the bfloat16 one is the first reply's."""

        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            replies = list(replies)
            kept = [r.content["arrays"]["odd"] for r in replies]  # type: ignore[index]
            assert all(a.data == raw and a.dtype == "bfloat16" for a in kept)
            for reply in replies:
                del reply.content["arrays"]["odd"]  # type: ignore[union-attr]
            arrays, metrics = super().aggregate_train(server_round, replies)
            assert arrays is not None
            arrays["odd"] = kept[0]
            return arrays, metrics

    app = ClientApp(mods=[ternary_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = msg.content["arrays"]
        assert isinstance(model, ArrayRecord) and model["odd"].data == raw
        arrays = {n: Array(a.numpy() * 0.9) for n, a in model.items() if n != "odd"}
        arrays["odd"] = model["odd"]
        metrics = MetricRecord({"num-examples": 1})
        content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics})  # type: ignore[arg-type]
        return Message(content=content, reply_to=msg)

    grid = InlineGrid(app, NODES)
    wire = _Wire(grid)
    strategy = TernaryDelta(Echo(fraction_train=1.0, fraction_evaluate=0.0))
    initial = ArrayRecord(_net().state_dict())
    initial["odd"] = odd
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=3)
    assert result.arrays["odd"].data == raw and strategy.dropped == {}
    assert all(wire.deltas[(r, "train")] == NODES for r in range(1, 4))
    assert wire.updates[(3, "train")] == NODES
    assert result.train_metrics_clientapp[3]["fedddl.up.compressed"] == NODES
