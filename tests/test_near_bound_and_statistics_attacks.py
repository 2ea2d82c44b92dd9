"""Attacks just under the scale bound and forged BatchNorm statistics (kinds and defences)."""

from __future__ import annotations

import logging

import pytest
import torch

from fedddl.attacks.spec import Attack, parse_attack
from fedddl.attacks.tamper import forged_statistics, rewrite_payload, tamper_reply
from fedddl.compression import (
    IdentityCompressor,
    TernaryCompressor,
    decode_update,
    encode_update,
    read_header,
)
from fedddl.running_stats import StatisticsPool
from fedddl.sync import ReplicaServer
from tests.test_untrusted_statistics import _bn_net, _reply
from tests.test_untrusted_statistics import _stats as _bn_stats


def test_near_bound_and_bn_statistics_parse_with_a_factor() -> None:
    assert parse_attack("near-bound:7.9") == Attack("near-bound", 7.9)
    assert parse_attack("bn-statistics:2") == Attack("bn-statistics", 2.0)
    with pytest.raises(ValueError, match="needs an argument"):
        parse_attack("near-bound")


def test_near_bound_negates_the_codes_at_f_times_the_scale() -> None:
    torch.manual_seed(0)
    grads = {"w": torch.randn(64), "b": torch.randn(3)}
    honest = encode_update(grads, TernaryCompressor(seed=0), dense=("b",))
    forged = rewrite_payload(honest, Attack("near-bound", 7.9))
    h, f = decode_update(honest), decode_update(forged)
    scale = {e.name: e.scale for e in read_header(honest) if e.codec is not None}["w"]
    assert {e.name: e.scale for e in read_header(forged) if e.codec}["w"] == pytest.approx(
        7.9 * scale, rel=1e-6
    )
    assert torch.equal(torch.sign(f["w"]), -torch.sign(h["w"]))
    assert torch.allclose(f["b"], -7.9 * h["b"])


def _stats(mean: float, var: float) -> dict[str, torch.Tensor]:
    return {
        "bn.mean": torch.full((4,), mean),
        "bn.var": torch.full((4,), var),
        "bn.count": torch.tensor([100.0]),
    }


def test_forged_statistics_push_the_mean_and_zero_the_variance() -> None:
    honest = _stats(0.5, 2.0)
    honest["bn.mean"][0] = -1.0
    forged = decode_update(forged_statistics(encode_update(honest, IdentityCompressor()), 7.9))
    assert torch.allclose(forged["bn.mean"], torch.full((4,), 7.9))
    assert torch.equal(forged["bn.var"], torch.zeros(4))


def test_robust_pool_ignores_one_forged_client_in_ten_and_the_mean_pool_does_not() -> None:
    honest = [_stats(0.1 * i, 1.0 + 0.01 * i) for i in range(9)]
    forged = _stats(7.9 * 0.8, 0.0)
    robust, plain = StatisticsPool(robust=True), StatisticsPool()
    for stats in [*honest, forged]:
        robust.add(stats)
        plain.add(stats)
    got, mean = robust.result(), plain.result()
    assert float(got["bn.mean"].max()) <= 0.8  # within the honest range
    assert 0.9 < float(got["bn.var"].min()) < 1.5
    assert float(mean["bn.mean"].max()) > 0.9  # the equal-weight mean is pulled
    assert float(got["bn.count"]) == 1000


def test_forged_statistics_from_one_client_in_ten_do_not_move_the_shadow() -> None:
    """The server pools statistics robustly: the shadow's running mean after a round stays
    within what the honest clients alone could give; with equal weights it would not."""
    server = ReplicaServer(_bn_net, compressor="identity", fp32_logits=False)
    nodes = tuple(range(1, 11))
    bn = server.shadow.model.get_submodule("1")
    momentum = float(bn.momentum or 0.0)
    honest_peak = 0.0
    for _ in range(3):
        version = server.shadow.version + 1
        server.plan_round(version, nodes)
        replies = []
        for n in nodes:
            stats = _bn_stats(0.5 + 0.01 * n)
            reply = _reply(server, n, stats)
            if n == 10:
                reply = tamper_reply(reply, Attack("bn-statistics", 7.9))
            else:
                honest_peak = max(honest_peak, float(stats["1.mean"].max()))
            replies.append(reply)
        before = bn.running_mean.clone()
        report = server.aggregate(version, replies)
        assert 10 in report.accepted and not report.skipped
        reach = (1 - momentum) * before + momentum * honest_peak
        assert bool((bn.running_mean <= reach + 1e-6).all()), (bn.running_mean, reach)
        assert float(bn.running_var.min()) > 0.5  # not pulled towards the forged 0


def test_a_node_clipped_every_round_is_warned_about_once_per_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = ReplicaServer(_bn_net, compressor="identity", fp32_logits=False)
    nodes = (1, 2, 3, 4, 5)
    with caplog.at_level(logging.DEBUG, logger="fedddl"):
        for _ in range(3):
            version = server.shadow.version + 1
            server.plan_round(version, nodes)
            replies = [
                _reply(server, n, _bn_stats(mean=1e12) if n == 5 else _bn_stats(0.5 + 0.01 * n))
                for n in nodes
            ]
            report = server.aggregate(version, replies)
            assert "statistics" in report.clipped[5]  # every round in the report
    clips = [  # the statistics bound's clips (the norm clip logs its own, once)
        r
        for r in caplog.records
        if "clipping reply: node 5:" in r.getMessage() and "norm over" not in r.getMessage()
    ]
    assert [r.levelno for r in clips] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
