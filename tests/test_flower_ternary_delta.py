"""``ternary_mod`` + ``TernaryDelta`` around stock FedAvg, in-process (InlineGrid).

A tiny model with an integer buffer (BatchNorm's ``num_batches_tracked``), one SGD step
per round. Checked: the clients' broadcast models equal the server's bit for bit; the
uplink really is the reply's model (restored within the ternary error); plain
clients and plain servers pass through; malformed replies are dropped with a reason
and the node gets the whole model next time; a client that lost its state recovers.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedddl.compression import BUCKETS_VERSION, IdentityCompressor, decode_update, encode_update
from fedddl.flower import TernaryDelta, ternary_mod
from fedddl.flower.delta_mod import STATE_MODEL, STATE_MODEL_LAYOUT
from fedddl.flower.delta_protocol import DELTA, DELTA_KEY, META, UPDATES, digest, split_model
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.records import array_to_bytes, bytes_to_array, unpack_tensors

NODES = 4
#: The labelling rule of every client's data: honest clients share a task, so their
#: updates share a direction (which the wrapper's direction check relies on).
_TEACHER = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _client_app(mods: list[Any]) -> ClientApp:
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        net = _net()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        node = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])  # type: ignore[index, arg-type]
        g = torch.Generator().manual_seed(100 * rnd + node)
        x = torch.randn(32, 6, generator=g)
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
        net = _net()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        metrics = MetricRecord({"acc": 0.5, "num-examples": 1})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def _run(
    grid: InlineGrid, strategy: Any, rounds: int = 3
) -> tuple[Any, list[ArrayRecord]]:
    seen: list[ArrayRecord] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        seen.append(arrays)
        return MetricRecord({"ok": 1})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=rounds,
        train_config=ConfigRecord({}),
        evaluate_fn=central,
    )
    return result, seen


def _spy(grid: InlineGrid) -> list[dict[str, Any]]:
    """What the server sent, summarised at send time (the in-process mod rewrites the
    delivered message objects, which a real transport would have serialized)."""
    sent: list[dict[str, Any]] = []
    original = grid.send_and_receive

    def send_and_receive(messages: Any, *, timeout: float | None = None) -> Any:
        messages = list(messages)
        for m in messages:
            meta = m.content.get(META)
            sent.append(
                {
                    "node": m.metadata.dst_node_id,
                    "type": m.metadata.message_type,
                    "round": m.content["config"]["server-round"],  # type: ignore[index]
                    "base": None if meta is None else meta["base"],  # type: ignore[index]
                    "updates": UPDATES in m.content,
                    "arrays": list(m.content["arrays"].keys()),  # type: ignore[union-attr]
                }
            )
        return original(messages, timeout=timeout)

    grid.send_and_receive = send_and_receive  # type: ignore[method-assign]
    return sent


def _fedavg(fraction_evaluate: float = 0.5) -> FedAvg:
    return FedAvg(
        fraction_train=1.0, fraction_evaluate=fraction_evaluate, min_available_nodes=NODES
    )


def _held(context: Context) -> dict[str, torch.Tensor]:
    state = context.state
    return unpack_tensors(state[STATE_MODEL]["blob"], state[STATE_MODEL_LAYOUT])  # type: ignore[index, arg-type]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_clients_hold_the_servers_broadcast_model_bit_for_bit() -> None:
    replies: list[tuple[int, str, list[str], bool]] = []

    def look(message: Message, reply: Message) -> Message:
        if message.metadata.message_type == "train" and not reply.has_error():
            record = reply.content["arrays"]
            rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
            replies.append((rnd, "", list(record.keys()), DELTA in reply.content))  # type: ignore[union-attr]
        return reply

    grid = InlineGrid(_client_app([ternary_mod]), NODES, tamper=look)
    sent = _spy(grid)
    # the delta downlink (UPDATES, the model in context.state); all get the last broadcast
    strategy = TernaryDelta(_fedavg(fraction_evaluate=1.0), downlink="delta")
    result, _ = _run(grid, strategy, rounds=4)
    assert result.arrays is not None and strategy.dropped == {}
    server = split_model(strategy.broadcast_model()).floats  # type: ignore[arg-type]
    for context in grid.contexts.values():
        held = _held(context)
        assert list(held) == list(server)
        assert all(torch.equal(held[n], server[n]) for n in server)
    # the broadcast model trails the exact FedAvg model only by the downlink error
    exact = split_model(result.arrays).floats
    for name, tensor in exact.items():
        err = (tensor - server[name]).abs().max()
        assert err <= 0.5 * tensor.abs().max() + 1e-6, name
    # after round 1 the model travels as updates; integer buffers travel exact
    first = [m for m in sent if m["round"] == 1 and m["type"] == "train"]
    late = [m for m in sent if m["round"] > 1]
    whole = list(_net().state_dict())
    assert all(m["base"] == -1 and not m["updates"] and m["arrays"] == whole for m in first)
    assert late and all(m["updates"] and m["base"] >= 1 for m in late)
    # FedAvg averages the integer buffer into float64: from round 2 on it is a float array
    assert all(m["arrays"] == [] for m in late)
    assert int(result.arrays["1.num_batches_tracked"].numpy()) == 4
    # every reply travels as a delta; an integer array travels exact beside it
    assert len(replies) == 4 * NODES and all(has_delta for *_, has_delta in replies)
    assert all(keys == ["1.num_batches_tracked"] for rnd, _, keys, _ in replies if rnd == 1)
    assert all(keys == [] for rnd, _, keys, _ in replies if rnd > 1)  # cast like the model


@pytest.mark.parametrize("compressor", ["ternary-threshold-base3", "ternary"])
def test_uplink_restores_the_reply_model_within_the_ternary_error(compressor: str) -> None:
    """The server decodes each reply to (global model + delta): one round moves the
    global model in nearly the direction of the uncompressed run of the same clients."""
    plain, _ = _run(InlineGrid(_client_app([]), NODES), _fedavg(), rounds=1)
    grid = InlineGrid(_client_app([ternary_mod]), NODES)
    strategy = TernaryDelta(_fedavg(), compressor=compressor, error_feedback=False)
    compressed, _ = _run(grid, strategy, rounds=1)
    start = split_model(ArrayRecord(_net().state_dict())).floats
    a, b = split_model(plain.arrays).floats, split_model(compressed.arrays).floats
    step_plain = torch.cat([(a[n] - start[n]).reshape(-1) for n in start])
    step_ternary = torch.cat([(b[n] - start[n]).reshape(-1) for n in start])
    cosine = torch.nn.functional.cosine_similarity(step_plain, step_ternary, dim=0)
    assert cosine > 0.75, float(cosine)  # measured 0.88 / 0.90
    assert not torch.equal(step_plain, step_ternary)  # it really was compressed


def test_scale_buckets_travel_both_ways() -> None:
    """With ``scale_bucket`` the nodes encode their deltas in buckets too (told in META):
    every reply is admitted and every client holds the broadcast model bit for bit."""
    payloads: list[bytes] = []

    def look(message: Message, reply: Message) -> Message:
        if message.metadata.message_type == "train" and DELTA in reply.content:
            payloads.append(array_to_bytes(reply.content[DELTA][DELTA_KEY]))  # type: ignore[index, arg-type]
        return reply

    grid = InlineGrid(_client_app([ternary_mod]), NODES, tamper=look)
    strategy = TernaryDelta(_fedavg(fraction_evaluate=1.0), scale_bucket=8, downlink="delta",
                            compressor="ternary-threshold-base3")
    result, _ = _run(grid, strategy, rounds=3)
    assert result.arrays is not None and strategy.dropped == {}
    server = split_model(strategy.broadcast_model()).floats  # type: ignore[arg-type]
    for context in grid.contexts.values():
        held = _held(context)
        assert all(torch.equal(held[n], server[n]) for n in server)
    assert payloads and all(p[4] == BUCKETS_VERSION for p in payloads)


def test_plain_clients_and_plain_servers_pass_through() -> None:
    # a ClientApp without the mod behind TernaryDelta: served and answered as usual
    grid = InlineGrid(_client_app([]), NODES)
    sent = _spy(grid)
    strategy = TernaryDelta(_fedavg())
    result, _ = _run(grid, strategy, rounds=2)
    assert result.arrays is not None and len(result.train_metrics_clientapp) == 2
    assert all(m["base"] == -1 for m in sent if m["round"] == 1 and m["type"] == "train")
    # after their first reply, plain nodes get FedAvg's messages unchanged
    assert all(m["base"] is None for m in sent if m["round"] == 2)
    # the mod in a ClientApp whose server is stock FedAvg: nothing changes
    grid = InlineGrid(_client_app([ternary_mod]), NODES)
    sent = _spy(grid)
    result, _ = _run(grid, _fedavg(), rounds=2)
    assert result.arrays is not None
    assert sent and all(m["base"] is None for m in sent)


def _tampered(
    change: Callable[[RecordDict], None], victim: int = 1001, from_round: int = 2
) -> Callable[[Message, Message], Message]:
    def tamper(message: Message, reply: Message) -> Message:
        rnd = message.content["config"]["server-round"]  # type: ignore[index]
        if (
            message.metadata.dst_node_id == victim
            and message.metadata.message_type == "train"
            and rnd == from_round  # type: ignore[comparison-overlap]
            and not reply.has_error()
        ):
            change(reply.content)
        return reply

    return tamper


def _truncate(content: RecordDict) -> None:
    data = bytes(content[DELTA][DELTA_KEY].data)  # type: ignore[index, union-attr]
    content[DELTA] = ArrayRecord({DELTA_KEY: bytes_to_array(data[:-9])})  # type: ignore[arg-type]


def _non_finite(content: RecordDict) -> None:
    """A well-formed fp32 (identity) delta of the right tensors with one +inf in it."""
    sent = decode_update(array_to_bytes(content[DELTA][DELTA_KEY]))  # type: ignore[index, arg-type]
    zeros = {n: torch.zeros_like(t) for n, t in sent.items()}
    raw = bytearray(encode_update(zeros, IdentityCompressor())[:-4])
    at = raw.rfind(struct.pack("<f", 0.0) * 3)  # the last tensor's data (3 fp32 biases)
    raw[at : at + 4] = struct.pack("<f", float("inf"))
    data = bytes(raw) + struct.pack("<I", zlib.crc32(bytes(raw)))  # a valid CRC again
    content[DELTA] = ArrayRecord({DELTA_KEY: bytes_to_array(data)})  # type: ignore[arg-type]


def _wrong_version(content: RecordDict) -> None:
    content[META]["version"] = 99  # type: ignore[index]


def _no_delta(content: RecordDict) -> None:
    del content[DELTA]


def _meta_not_a_config(content: RecordDict) -> None:
    content[META] = ArrayRecord({"x": Array(torch.zeros(1).numpy())})  # type: ignore[arg-type]


def _float_smuggled(content: RecordDict) -> None:
    content["arrays"]["0.weight"] = Array(torch.zeros(16, 6).numpy())  # type: ignore[index]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_truncate, "PayloadError"),
        (_non_finite, "non-finite"),
        (_wrong_version, "answers version 99"),
        (_no_delta, "no 'fedddl.ternary.delta' ArrayRecord"),
        (_meta_not_a_config, "not a ConfigRecord"),
        (_float_smuggled, "exactly the non-float arrays"),
    ],
)
def test_a_malformed_reply_is_dropped_with_its_reason(
    change: Callable[[RecordDict], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    grid = InlineGrid(_client_app([ternary_mod]), NODES, tamper=_tampered(change))
    sent = _spy(grid)
    strategy = TernaryDelta(_fedavg(), downlink="delta")  # a resync is the whole model
    with caplog.at_level(logging.WARNING):
        result, _ = _run(grid, strategy, rounds=3)
    assert result.arrays is not None  # the server did not crash; rounds completed
    assert sum(strategy.dropped.values()) == 1
    messages = [r.getMessage() for r in caplog.records]
    dropped = [m for m in messages if "TernaryDelta dropped the reply of node 1001" in m]
    assert dropped and (reason in dropped[0] or reason in str(strategy.dropped)), messages
    # the victim's next message carries the whole model (base -1), the others updates
    at = next(i for i, m in enumerate(sent) if m["node"] == 1001 and m["round"] == 2)
    after = [m for m in sent[at + 1 :] if m["node"] == 1001]
    assert after and after[0]["base"] == -1 and all(m["base"] >= 1 for m in after[1:])
    # (round 2 may still be whole for some: FedAvg turned the integer buffer into float64
    # in round 1, a new model layout)
    others = [m for m in sent if m["node"] != 1001 and m["round"] >= 3]
    assert others and all(m["base"] >= 1 for m in others)


def test_a_client_that_lost_its_state_recovers() -> None:
    def wipe(message: Message, context: Context) -> None:
        rnd = message.content["config"]["server-round"]  # type: ignore[index]
        if context.node_id == 1002 and rnd == 3 and message.metadata.message_type == "train":
            for key in list(context.state.keys()):
                del context.state[key]

    outcome: list[tuple[int, int, bool]] = []

    def look(message: Message, reply: Message) -> Message:
        if message.metadata.message_type == "train":
            rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
            outcome.append((rnd, message.metadata.dst_node_id, reply.has_error()))
        return reply

    grid = InlineGrid(_client_app([ternary_mod]), NODES, before=wipe, tamper=look)
    strategy = TernaryDelta(_fedavg(fraction_evaluate=1.0), downlink="delta")
    result, _ = _run(grid, strategy, rounds=5)
    assert result.arrays is not None
    failed = [(rnd, node) for rnd, node, error in outcome if error]
    assert failed == [(3, 1002)]  # it could not apply the update; every later round works
    server = split_model(strategy.broadcast_model()).floats  # type: ignore[arg-type]
    assert digest(_held(grid.contexts[1002])) == digest(server)


def test_a_corrupt_broadcast_is_refused_by_the_mod() -> None:
    def corrupt(message: Message, context: Context) -> None:
        updates = message.content.get(UPDATES)
        if context.node_id == 1000 and isinstance(updates, ArrayRecord) and len(updates):
            key = next(iter(updates))
            data = bytearray(updates[key].data)
            data[-1] ^= 0xFF  # breaks the CRC
            updates[key] = bytes_to_array(bytes(data))

    grid = InlineGrid(_client_app([ternary_mod]), NODES, before=corrupt)
    strategy = TernaryDelta(_fedavg(), downlink="delta")
    replies: list[Message] = []
    original = grid.send_and_receive

    def spy(messages: Any, *, timeout: float | None = None) -> Any:
        out = list(original(messages, timeout=timeout))
        replies.extend(out)
        return out

    grid.send_and_receive = spy  # type: ignore[method-assign]
    result, _ = _run(grid, strategy, rounds=3)
    errors = [r for r in replies if r.has_error()]
    assert errors and all("cannot apply the broadcast model" in r.error.reason for r in errors)
    assert result.arrays is not None


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown compressor"):
        TernaryDelta(_fedavg(), compressor="nope")
    with pytest.raises(TypeError, match="Flower Strategy"):
        TernaryDelta(object())  # type: ignore[arg-type]


def test_error_feedback_auto_is_off_for_strategies_that_do_not_average() -> None:
    from flwr.serverapp.strategy import (
        Bulyan,
        DifferentialPrivacyServerSideFixedClipping,
        FedAdam,
        FedMedian,
        FedTrimmedAvg,
        Krum,
        MultiKrum,
    )

    from fedddl.flower.error_feedback_choice import resolve_error_feedback

    for robust in (FedMedian(), FedTrimmedAvg(), Krum(), MultiKrum(), Bulyan()):
        assert TernaryDelta(robust).error_feedback is False
        assert TernaryDelta(robust, error_feedback=True).error_feedback is True
    assert TernaryDelta(FedAvg()).error_feedback is True
    assert TernaryDelta(FedAdam()).error_feedback is True
    inside_dp = DifferentialPrivacyServerSideFixedClipping(FedMedian(), 1.0, 1.0, 5)
    assert resolve_error_feedback("auto", inside_dp) == (
        False, "auto: FedMedian does not average every reply")
    assert resolve_error_feedback("auto", DifferentialPrivacyServerSideFixedClipping(
        FedAvg(), 1.0, 1.0, 5)) == (True, "auto")
    with pytest.raises(ValueError, match="error_feedback must be True, False or 'auto'"):
        TernaryDelta(FedAvg(), error_feedback="yes")
