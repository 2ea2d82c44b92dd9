"""Untrusted clients: malicious ClientApps that send well-formed messages must neither end
the server nor wreck the model (in-process ``InlineGrid``, real ServerApp loop, no Ray)."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from typing import Any

import pytest
import torch
from flwr.app import Message

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.attacks import attacker_partitions, parse_attack
from fedddl.attacks.tamper import many_tensors_payload
from fedddl.compression import TernaryCompressor, encode_update, get_compressor, read_header
from fedddl.flower.inline_grid import InlineGrid
from fedddl.sync import ReplicaServer
from fedddl.sync.resync_limit import ResyncLimiter
from fedddl.sync.screening import PayloadSpec
from strategies.server_app import run_server
from tests.test_sync_server import Cluster

NODES = 5


def _run(
    rounds: int, grid_nodes: int = NODES, **settings: Any
) -> tuple[dict[str, Any], InlineGrid]:
    cfg = AppConfig(num_server_rounds=rounds, min_available_nodes=grid_nodes, **settings)
    grid = InlineGrid(make_client_app(cfg), grid_nodes, keep_sent=True)
    result = run_server(grid, cfg, progress=lambda line: None)
    json.dumps(result, allow_nan=False)  # strict JSON, whatever the clients said
    return result, grid


def _attackers(num: int, settings: dict[str, Any] | None = None) -> set[int]:
    seed = (settings or {}).get("seed", 0)
    return {1000 + pid for pid in attacker_partitions(NODES, num, seed)}


@pytest.fixture(scope="module")
def clean() -> dict[str, Any]:
    result, _ = _run(6)
    return result


@pytest.mark.parametrize("attack", ["scale:1e6", "scale:1e38"])
def test_a_huge_scale_is_clipped_and_the_run_learns_as_without_it(
    attack: str, clean: dict[str, Any]
) -> None:
    # the scale bound alone (the norm clip, on by default, also clips honest replies)
    result, _ = _run(6, attack=attack, num_attackers=1, norm_clip=0.0)
    bad = _attackers(1)
    assert result["attack"]["node_ids"] == sorted(bad)
    assert result["attack"]["partition_ids"] == [n - 1000 for n in sorted(bad)]
    for r in result["rounds"]:
        assert set(r["clipped"]) == {str(n) for n in bad}, r["clipped"]
        assert not r["dropped"] and not r["skipped"] and r["replicas_equal_honest"]
    assert "exceeds the bound" in result["rounds"][0]["clipped"][str(next(iter(bad)))]
    assert result["summary"]["clipped_honest_replies"] == 0
    # 1 of 5 clients, clipped to 8 x the median scale: still learning like the clean run.
    assert result["final_accuracy"] > clean["final_accuracy"] - 0.10, (
        result["final_accuracy"],
        clean["final_accuracy"],
    )


def test_without_the_bound_a_huge_scale_wrecks_the_model_but_never_ends_the_server() -> None:
    result, _ = _run(4, attack="scale:1e38", num_attackers=1, scale_bound=0, norm_clip=0.0)
    assert result["final_accuracy"] < 0.3  # the plain mean is poisoned...
    assert len(result["rounds"]) == 4  # ...but every round ran
    # Once the weights blew up every client's gradient is NaN: dropped, round skipped.
    assert result["rounds"][-1]["skipped"]
    assert "no valid reply" in result["rounds"][-1]["skip_reason"]


@pytest.mark.parametrize(
    ("attack", "reason"),
    [
        ("nan-metrics", "'loss' must be finite"),
        ("inf-metrics", "'loss' must be finite"),
        ("huge-examples", "num-examples must be in [1, 32]"),
        ("many-tensors", "exceeds the limit"),
    ],
)
def test_bad_metrics_and_oversized_payloads_are_dropped_with_a_reason(
    attack: str, reason: str
) -> None:
    result, _ = _run(5, attack=attack, num_attackers=1)
    (bad,) = _attackers(1)
    for r in result["rounds"]:
        assert set(r["dropped"]) == {str(bad)} and reason in r["dropped"][str(bad)], r["dropped"]
        assert r["accepted"] == NODES - 1 and r["train_loss"] is not None
    if attack == "many-tensors":  # refused from its header: the node's version is known
        assert not any(r["resync_limited"] for r in result["rounds"])
        return
    # An unparseable reply leaves the node's version unknown: its resyncs are rate-limited.
    down = [r["bytes_down_attackers"] for r in result["rounds"]]
    honest = [(r["bytes_down"] - r["bytes_down_attackers"]) / (NODES - 1) for r in result["rounds"]]
    assert all(d <= 2.5 * h for d, h in zip(down[3:], honest[3:], strict=True)), (down, honest)
    assert any(r["resync_limited"] for r in result["rounds"])


def test_resync_spam_and_a_lying_fingerprint_get_rate_limited_snapshots() -> None:
    rounds = 9
    for attack in ("resync-spam", "fingerprint-lie"):
        result, grid = _run(rounds, attack=attack, num_attackers=1, resync_interval=3)
        (bad,) = _attackers(1)
        snapshots: dict[int, list[int]] = {}
        for m in grid.sent:
            if "snapshot" in m.content.array_records:
                rnd = int(m.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
                snapshots.setdefault(m.metadata.dst_node_id, []).append(rnd)
        # Served at rounds 2, then after 3, then after 6 rounds (backoff): 2, 5, 11 > 9.
        assert snapshots == {bad: [2, 5]}, (attack, snapshots)
        held = [r["round"] for r in result["rounds"] if r["resync_limited"]]
        assert held == [3, 4, 6, 7, 8, 9], (attack, held)
        for r in result["rounds"]:
            assert r["replicas_equal_honest"] is True
            assert r["accepted"] == NODES - 1
        if attack == "fingerprint-lie":
            assert all(r["mismatched"] == [bad] for r in result["rounds"])
            assert result["summary"]["replicas_equal_all"] is False  # the liar, reported apart
            assert result["summary"]["replicas_equal_honest_all"] is True


def test_resync_limiter_backs_off_and_resets_after_a_valid_reply() -> None:
    from fedddl.sync.errors import ResyncRequest

    limiter = ResyncLimiter(interval=10)
    limiter.learn(7, ResyncRequest("lost"))
    served = []
    for rnd in range(1, 80):
        if not limiter.holds_back(7, rnd):
            limiter.served(7, rnd)
            served.append(rnd)
    assert served == [1, 11, 31, 71]
    limiter.learn(7, None)  # a valid reply: back to the plain interval
    limiter.learn(7, ResyncRequest("lost again"))
    assert limiter.holds_back(7, 75) and not limiter.holds_back(7, 81)
    assert not limiter.holds_back(8, 2)  # never asked: never limited
    assert not ResyncLimiter(interval=0).holds_back(7, 2)


def test_shared_scale_sum_cannot_be_set_by_one_client() -> None:
    cluster = Cluster(downlink="shared-scale-sum", compressor="ternary")
    replies = cluster.replies()
    honest = torch.stack([r.scales for r in replies[1:] if r.scales is not None])
    liar = dataclasses.replace(replies[0], scales=torch.full_like(honest[0], 1e6))
    cluster.server.aggregate(1, [liar, *replies[1:]])
    shared = cluster.server.shared_scales
    assert shared is not None
    median = torch.stack([liar.scales, *honest]).sort(dim=0).values[1]  # type: ignore[misc]
    assert bool((shared <= 8 * median + 1e-9).all()) and float(shared.max()) < 1.0
    # Replies whose local-scale vector does not fit the model are refused, not trusted.
    replies = cluster.replies()
    short = dataclasses.replace(replies[0], scales=torch.ones(1))
    report = cluster.server.aggregate(2, [short, *replies[1:]])
    assert "local scales for 4 tensors" in report.dropped[short.node_id]
    assert cluster.server.shared_scales is not None


@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean", "sign-vote"])
def test_robust_aggregators_run_end_to_end(aggregator: str) -> None:
    result, _ = _run(3, attack="sign-flip", num_attackers=1, aggregator=aggregator)
    assert result["config"]["aggregator"] == aggregator
    assert [r["model_version"] for r in result["rounds"]] == [1, 2, 3]
    assert result["final_accuracy"] > result["initial"]["accuracy"]


def test_exceptions_in_override_points_drop_a_reply_or_skip_a_round(
    fedddl_warnings: list[str],
) -> None:
    class Buggy(ReplicaServer):
        def validate_reply(self, reply, expected_version):  # type: ignore[no-untyped-def]
            if reply.node_id == 12:
                raise RuntimeError("bug on hostile input")
            super().validate_reply(reply, expected_version)

    cluster = Cluster()
    cluster.server.__class__ = Buggy
    report = cluster.server.aggregate(1, cluster.replies())
    assert "RuntimeError: bug on hostile input" in report.dropped[12]
    assert report.version == 1 and len(report.accepted) == 3

    def broken_aggregate(contributions):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("aggregator bug")

    cluster.server.aggregate_gradients = broken_aggregate  # type: ignore[method-assign]
    report = cluster.server.aggregate(2, cluster.replies())
    assert report.skipped and report.version == 1
    assert "aggregation failed: ZeroDivisionError" in report.skip_reason

    def unencodable(server_round, aggregate):  # type: ignore[no-untyped-def]
        raise ValueError("tensor has NaN or Inf values")

    del cluster.server.aggregate_gradients
    cluster.server.encode_downlink = unencodable  # type: ignore[method-assign]
    before = cluster.server.shadow.fingerprint()
    report = cluster.server.aggregate(3, cluster.replies())
    assert report.skipped and report.version == 1 and report.downlink_format == "none"
    assert "could not be encoded or applied" in report.skip_reason
    assert cluster.server.shadow.fingerprint() == before and len(cluster.server.log) == 1
    assert any("round 3 skipped: the aggregate could not be encoded" in w for w in fedddl_warnings)


def test_an_aggregate_beyond_float32_is_encoded_not_fatal() -> None:
    """The issue's crash: a scale >= 1e19 overflowed the float32 sum of squares when the
    server re-encoded the aggregate. Without the bound, the round is now applied."""
    cluster = Cluster(scale_bound=0)
    replies = cluster.replies()
    from fedddl.attacks.tamper import tamper_reply

    attack = parse_attack("scale:1e22")  # honest scales ~1e-2: poisoned ones ~1e20
    assert attack is not None
    poisoned = [tamper_reply(replies[0], attack), *replies[1:]]
    report = cluster.server.aggregate(1, poisoned)
    assert not report.skipped and report.version == 1 and not report.dropped
    assert report.downlink_format == "encoded"


def test_expected_shape_first_without_decoding_or_allocating() -> None:
    model = AppConfig().model_factory()()
    spec = PayloadSpec.for_model(model, get_compressor("ternary-base3"))
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    good = encode_update(grads, TernaryCompressor(seed=0, codec="base3"))
    assert [e.name for e in spec.check(good, 1).entries] == list(grads)
    from fedddl.sync.errors import PayloadRejected

    with pytest.raises(PayloadRejected, match="uses codec '2bit', expected base3"):
        spec.check(encode_update(grads, TernaryCompressor(seed=0)), 1)
    shapes = dict(grads)
    shapes["1.bias"] = torch.zeros(3)
    with pytest.raises(PayloadRejected, match=r"'1.bias' has shape \(3,\)"):
        spec.check(encode_update(shapes, TernaryCompressor(seed=0, codec="base3")), 1)
    payload = many_tensors_payload()
    assert len(payload) > 1_000_000
    assert len(read_header(payload, max_tensors=1 << 16)) == 1 << 16  # a valid message
    tracemalloc.start()
    try:
        with pytest.raises(PayloadRejected, match="exceeds the limit"):
            spec.check(payload, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak  # rejected from its length, nothing decoded
    assert spec.max_bytes < 8 * 1024 * 1024


def test_attack_settings_are_checked_and_attackers_are_deterministic() -> None:
    assert attacker_partitions(10, 3, seed=0) == attacker_partitions(10, 3, seed=0)
    assert attacker_partitions(10, 3, seed=0) != attacker_partitions(10, 3, seed=1)
    assert len(set(attacker_partitions(10, 10, seed=4))) == 10
    with pytest.raises(ValueError, match="num-attackers"):
        attacker_partitions(4, 5, seed=0)
    for spec, message in [
        ("scale", "needs an argument"),
        ("scale:-1", "finite and > 0"),
        ("sign-flip:2", "takes no argument"),
        ("krum", "attack kind must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            AppConfig(attack=spec, num_attackers=1)
    with pytest.raises(ValueError, match="needs num-attackers"):
        AppConfig(attack="sign-flip")
    with pytest.raises(ValueError, match="needs an attack"):
        AppConfig(num_attackers=2)
    cfg = AppConfig.from_run_config({"attack": "scale:1e30", "num-attackers": 1})
    assert str(parse_attack(cfg.attack)) == "scale:1e+30"


def test_simulate_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from fedddl.commands import simulate

    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    seen: list[AppConfig] = []

    def fake(cfg: AppConfig, **kwargs: Any) -> dict[str, Any]:
        seen.append(cfg)
        return {"summary": {}}

    monkeypatch.setattr("fedddl.flower.simulation.run", fake)
    flags = (
        "--attack sign-flip --num-attackers 3 --aggregator trimmed-mean --trim-fraction 0.3 "
        "--scale-bound 4 --scale-bound-action drop --scale-bound-rounds 2 --resync-interval 5 "
        "--scale-weight 1.5 --direction-check 0.3"
    )
    args = parser.parse_args(flags.split(" "))
    assert simulate.run(args) == 0
    cfg = seen[0]
    assert (cfg.attack, cfg.num_attackers, cfg.aggregator, cfg.trim_fraction) == (
        "sign-flip",
        3,
        "trimmed-mean",
        0.3,
    )
    assert (cfg.scale_bound, cfg.scale_bound_action, cfg.scale_bound_rounds) == (4.0, "drop", 2)
    assert cfg.resync_interval == 5 and cfg.scale_weight == 1.5
    assert cfg.defenses().scale_weight == 1.5
    assert cfg.direction_check == 0.3 and cfg.defenses().direction_check == 0.3
    default = AppConfig.from_run_config({})
    assert default.direction_check == 0.1 and default.defenses().direction_check == 0.1
    assert simulate.run(parser.parse_args(["--attack", "bogus", "--num-attackers", "1"])) == 2
    assert simulate.run(parser.parse_args(["--num-attackers", "11"])) == 2


def test_roll_call_reply_of_a_node(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = AppConfig(num_server_rounds=1, min_available_nodes=3)
    grid = InlineGrid(make_client_app(cfg), 3, keep_sent=True)
    from strategies.roll_call import roll_call

    assert roll_call(grid, 3) == {1000: 0, 1001: 1, 1002: 2}
    assert isinstance(grid.sent[0], Message)
