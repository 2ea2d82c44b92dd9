"""TernGrad / GradientAverage protocol with real Flower Messages, in-process (no Ray).

Each test drives ``Strategy.start`` on an :class:`~fedddl.flower.inline_grid.InlineGrid`
that delivers every message to the real ClientApp with per-node ``context.state``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, Context, Error, Message, RecordDict

from clients.client_app import make_client_app
from clients.state import load_state
from fedddl.app_config import AppConfig
from fedddl.compression import IdentityCompressor, encode_update
from fedddl.compression.codecs.downlink import decode_broadcast_parts
from fedddl.flower.grid import CountingGrid
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.records import bytes_to_array
from strategies.registry import build_strategy
from strategies.terngrad import TernGrad


def _run(
    cfg: AppConfig,
    nodes: int,
    rounds: int,
    tamper: Callable[[Message, Message], Message] | None = None,
    before: Callable[[Message, Context], None] | None = None,
) -> tuple[TernGrad, InlineGrid]:
    grid = InlineGrid(
        make_client_app(cfg), nodes, tamper=tamper, before=before, keep_sent=True
    )
    strategy = build_strategy(cfg, cfg.model_factory())
    assert isinstance(strategy, TernGrad)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=rounds)
    return strategy, grid


def _client_fingerprints(grid: InlineGrid, cfg: AppConfig) -> dict[int, tuple[int, str]]:
    out = {}
    for node, ctx in grid.contexts.items():
        st = load_state(
            ctx.state, cfg.model_factory(), cfg.learning_rate, cfg.momentum
        )
        if st.replica is not None:
            out[node] = (st.replica.version, st.replica.fingerprint())
    return out


def _round_of(message: Message) -> int:
    return int(message.content.config_records["config"]["server-round"])  # type: ignore[arg-type]


def test_every_client_replica_equals_the_shadow_and_no_weights_travel() -> None:
    cfg = AppConfig(num_server_rounds=4)
    strategy, grid = _run(cfg, nodes=5, rounds=4)
    assert [r.replicas_equal for r in strategy.server.reports] == [True] * 4
    assert all(len(r.accepted) == 5 and not r.dropped for r in strategy.server.reports)
    assert strategy.server.shadow.version == 4
    fps = _client_fingerprints(grid, cfg)
    assert len(fps) == 5
    # Clients hold version 3 (round 4's aggregate goes out with round 5's message).
    assert {v for v, _ in fps.values()} == {3}
    assert {fp for _, fp in fps.values()} == {strategy.server.fingerprints[3]}
    assert strategy.server.fingerprints[3] != strategy.server.fingerprints[0]
    # One message per client per round, never a snapshot, one update from round 2 on.
    assert len(grid.sent) == 20
    for m in grid.sent:
        assert "snapshot" not in m.content.array_records
        ups = m.content.array_records.get("updates")
        assert (0 if ups is None else len(ups)) == (0 if _round_of(m) == 1 else 1)


def _nan_payload() -> bytes:
    """A well-formed fp32 update (valid CRC) whose values are NaN: the encoder refuses
    NaN, so patch the value bytes of an all-ones update and redo the CRC."""
    model = AppConfig().model_factory()()
    ones = {k: torch.ones_like(p) for k, p in model.named_parameters()}
    body = encode_update(ones, IdentityCompressor())[:-4]
    one, nan = struct.pack("<f", 1.0), struct.pack("<f", float("nan"))
    body = body.replace(one * 16, nan * 16)
    return body + struct.pack("<I", zlib.crc32(body))


def _fault_injector(faults: dict[int, str], at_round: int) -> Callable[[Message, Message], Message]:
    def tamper(message: Message, reply: Message) -> Message:
        node = message.metadata.dst_node_id
        if _round_of(message) != at_round or node not in faults:
            return reply
        kind = faults[node]
        if kind == "error":
            return Message(Error(code=1, reason="client crashed"), reply_to=message)
        content = reply.content
        if kind == "missing-update":
            del content["update"]
        elif kind == "corrupt":
            raw = bytes(content.array_records["update"]["payload"].data)
            content.array_records["update"]["payload"] = bytes_to_array(raw[:-8] + b"garbage!")
        elif kind == "wrong-shape":
            bad = encode_update({"1.weight": torch.zeros(2, 2)}, IdentityCompressor())
            content.array_records["update"]["payload"] = bytes_to_array(bad)
        elif kind == "nan":
            content.array_records["update"]["payload"] = bytes_to_array(_nan_payload())
        elif kind == "fingerprint":
            content.config_records["replica"]["fingerprint"] = b"\x00" * 16
        elif kind == "version":
            content.metric_records["metrics"]["model-version"] = 99
        return reply

    return tamper


def test_bad_replies_are_dropped_with_reasons_and_poison_nothing() -> None:
    cfg = AppConfig(num_server_rounds=4)
    kinds = ["error", "missing-update", "corrupt", "wrong-shape", "nan", "fingerprint", "version"]
    faults = {1000 + i: kind for i, kind in enumerate(kinds)}
    strategy, grid = _run(cfg, nodes=9, rounds=4, tamper=_fault_injector(faults, at_round=2))
    r1, r2, r3, r4 = strategy.server.reports
    assert len(r1.accepted) == 9 and r1.replicas_equal
    assert r2.accepted == [1007, 1008]
    reasons = {faults[n]: why for n, why in r2.dropped.items()}
    assert "client crashed" in reasons["error"]
    assert "'update'" in reasons["missing-update"]
    assert "CRC" in reasons["corrupt"]
    assert "do not match" in reasons["wrong-shape"]
    # Expected shape first: refused from the header (a dense entry where the compressor
    # sends codes, or a non-finite value in an fp32-exempt dense entry), before decoding.
    assert "is dense" in reasons["nan"] or "non-finite value" in reasons["nan"]
    assert "fingerprint mismatch" in reasons["fingerprint"]
    assert "version 99" in reasons["version"]
    assert r2.replicas_equal is False  # a (claimed) divergent replica was seen
    assert r2.version == 2  # the round still completed with the two good replies
    # Next rounds: everyone (dropped ones too) applied the broadcast and is back in.
    assert len(r3.accepted) == 9 and r3.replicas_equal, r3.dropped
    assert len(r4.accepted) == 9 and r4.replicas_equal
    fps = _client_fingerprints(grid, cfg)
    assert {fp for _, fp in fps.values()} == {strategy.server.fingerprints[3]}
    # The node whose fingerprint looked wrong and the one claiming a version ahead of
    # the server were resynced with a snapshot in round 3; the others caught up by log.
    snap = {
        (m.metadata.dst_node_id, _round_of(m))
        for m in grid.sent
        if "snapshot" in m.content.array_records
    }
    assert snap == {(1005, 3), (1006, 3)}


def test_round_two_aggregate_is_the_mean_of_the_accepted_replies_only() -> None:
    cfg = AppConfig(num_server_rounds=2, strategy="gradient-average")
    faults = {1000: "corrupt"}
    seen: dict[int, Message] = {}

    def tamper(message: Message, reply: Message) -> Message:
        if _round_of(message) == 2:
            seen[message.metadata.dst_node_id] = reply
        return _fault_injector(faults, 2)(message, reply)

    strategy, _ = _run(cfg, nodes=3, rounds=2, tamper=tamper)
    from fedddl.compression import decode_update
    from fedddl.compression.codecs.downlink import decode_broadcast

    good = [decode_update(bytes(seen[n].content["update"]["payload"].data)) for n in (1001, 1002)]  # type: ignore[union-attr]
    expected = {k: (good[0][k] + good[1][k]) / 2 for k in good[0]}
    broadcast = decode_broadcast(strategy.server.log.since(1)[0][1])
    for k in expected:
        torch.testing.assert_close(broadcast[k], expected[k], rtol=0, atol=0)


def test_sampled_clients_catch_up_by_log_or_snapshot() -> None:
    cfg = AppConfig(
        num_server_rounds=10,
        fraction_train=0.34,
        update_log_size=2,
        seed=3,
        downlink="reternarize",  # the grid (auto's choice here) has one catch-up message
    )
    strategy, grid = _run(cfg, nodes=6, rounds=10)
    assert all(len(r.accepted) == 2 and not r.dropped for r in strategy.server.reports)
    assert all(r.replicas_equal for r in strategy.server.reports)
    kinds = set()
    for m in grid.sent:
        ups = m.content.array_records.get("updates")
        if "snapshot" in m.content.array_records:
            kinds.add("snapshot")
        elif ups is not None and len(ups) > 1:
            kinds.add("multi-update log")
    assert kinds == {"snapshot", "multi-update log"}
    for version, fp in _client_fingerprints(grid, cfg).values():
        assert fp == strategy.server.fingerprints[version]


def test_client_that_lost_its_state_resyncs_with_a_snapshot() -> None:
    cfg = AppConfig(num_server_rounds=5, update_log_size=8)

    def wipe(message: Message, context: Context) -> None:
        if _round_of(message) == 3 and context.node_id == 1001:
            context.state = RecordDict()

    strategy, grid = _run(cfg, nodes=3, rounds=5, before=wipe)
    r3, r4, r5 = strategy.server.reports[2:]
    assert "resync from version -1" in r3.dropped[1001]
    assert 1001 in r4.accepted and r4.replicas_equal and r5.replicas_equal
    snap = [m for m in grid.sent if "snapshot" in m.content.array_records]
    assert [(m.metadata.dst_node_id, _round_of(m)) for m in snap] == [(1001, 4)]


def test_terngrad_trains_and_gradient_average_sends_15x_more_bytes() -> None:
    """Per tensor 15x fewer bytes both ways; per output channel (the default; four bytes a
    row of 64 values of this MLP) 12x."""
    results = {}
    for strat, buckets in (("terngrad", 0), ("per-channel", "auto"), ("gradient-average", 0)):
        cfg = AppConfig(
            num_server_rounds=20,
            strategy="terngrad" if strat == "per-channel" else strat,
            fp32_logits=False,
            scale_bucket=buckets,
        )
        grid = CountingGrid(InlineGrid(make_client_app(cfg), 4))
        strategy = build_strategy(cfg, cfg.model_factory())
        strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=20)
        assert isinstance(strategy, TernGrad)
        model = cfg.model_factory()()
        model.load_state_dict(strategy.server.shadow.model.state_dict())
        from fedddl.data import as_tensors, load_dataset
        from fedddl.training import evaluate

        x, y = as_tensors(load_dataset("digits", split="test"))
        results[strat] = (evaluate(model, x, y)[1], grid.bytes_up, grid.bytes_down)
    tern, full = results["terngrad"], results["gradient-average"]
    channel = results["per-channel"]
    assert tern[0] > 0.6 and full[0] > 0.6 and channel[0] > 0.6, results
    assert full[1] / tern[1] >= 15, results
    assert full[2] / tern[2] >= 15, results
    assert full[1] / channel[1] >= 12 and full[2] / channel[2] >= 12, results


def test_shared_scale_sum_downlink_after_the_first_round() -> None:
    cfg = AppConfig(num_server_rounds=4, downlink="shared-scale-sum", fp32_logits=False)
    strategy, grid = _run(cfg, nodes=4, rounds=4)
    reports = strategy.server.reports
    assert [r.downlink_format for r in reports] == ["encoded"] + ["shared-scale-sum"] * 3
    assert all(r.replicas_equal for r in reports)
    clients = _client_fingerprints(grid, cfg)
    assert {fp for _, fp in clients.values()} == {strategy.server.fingerprints[3]}
    payload = strategy.server.log.since(3)[0][1]
    assert payload[:1] == b"S"


@pytest.mark.parametrize("downlink", ["shared-scale-sum", "reternarize"])
def test_every_downlink_with_batchnorm_statistics_and_fp32_logits(
    downlink: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BatchNorm statistics, fp32 logits and the downlink in one broadcast (one bundle).

    Regression: the shared-scale sum with fp32 tensors is already a bundle, and the
    statistics were wrapped around it as a bundle inside a bundle, which no decoder takes:
    every round after the first was skipped.
    """
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "docs" / "examples"))
    cfg = AppConfig(
        num_server_rounds=4, downlink=downlink, dataset="my_task:blobs",
        model="my_task:small_bn_cnn",
    )  # fmt: skip
    strategy, grid = _run(cfg, nodes=3, rounds=4)
    reports = strategy.server.reports
    assert not any(r.skipped for r in reports), [r.skip_reason for r in reports]
    assert strategy.server.shadow.version == 4
    expected = "shared-scale-sum" if downlink == "shared-scale-sum" else "encoded"
    assert [r.downlink_format for r in strategy.server.reports][1:] == [expected] * 3
    assert all(r.replicas_equal for r in strategy.server.reports)
    clients = _client_fingerprints(grid, cfg).values()
    assert set(clients) == {(3, strategy.server.fingerprints[3])}  # they apply update 4 next round
    update, statistics = decode_broadcast_parts(strategy.server.log.since(3)[0][1])
    assert "8.weight" in update and statistics  # fp32 logits and pooled statistics travel


@pytest.mark.parametrize("local_steps", [1, 3])
def test_pseudo_gradient_is_the_mean_of_local_gradients(local_steps: int) -> None:
    from fedddl.sync.worker import compute_pseudo_gradient
    from fedddl.training import compute_gradients, iterate_minibatches, named_gradients

    model = AppConfig().model_factory()()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.rand(50, 1, 8, 8), torch.randint(0, 10, (50,))
    grads, loss, examples, stats = compute_pseudo_gradient(
        model, x, y, batch_size=8, local_steps=local_steps, learning_rate=0.5, seed=1
    )
    assert examples == 8 * local_steps and loss > 0 and stats == {}  # no BatchNorm
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # Reference: plain SGD on a copy, pseudo-gradient = (w0 - wK) / (K lr).
    ref = AppConfig().model_factory()()
    batches = iterate_minibatches(x, y, 8, torch.Generator().manual_seed(1))
    for _ in range(local_steps):
        compute_gradients(ref, *next(batches))
        with torch.no_grad():
            for p in ref.parameters():
                assert p.grad is not None
                p.sub_(0.5 * p.grad)
    if local_steps == 1:
        ref_grads = named_gradients(ref)
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=0)
    w_k = dict(ref.named_parameters())
    for k in grads:
        torch.testing.assert_close(
            grads[k], (before[k] - w_k[k].detach()) / (0.5 * local_steps), rtol=1e-4, atol=1e-5
        )
