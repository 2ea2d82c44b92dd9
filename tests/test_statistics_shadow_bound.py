"""BatchNorm statistics bounded relative to the server shadow's own running statistics
(``statistics-bound``): a forged reply far from the shadow is clipped to the bound, an honest
one is untouched, nothing is bounded before the shadow has tracked a batch (first round),
and the shadow stays finite."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from fedddl.app_config import AppConfig
from fedddl.compression import IdentityCompressor, encode_update
from fedddl.defenses import Defenses
from fedddl.running_stats import apply_statistics
from fedddl.sync import ReplicaServer
from fedddl.sync.messages import ClientReply, fingerprint_prefix
from fedddl.sync.statistics_shadow import bound_statistics_to_shadow, shadow_reference

NODES = (1, 2, 3, 4, 5)
K = 4.0


def _layer(momentum: float | None = 0.1) -> nn.BatchNorm1d:
    return nn.BatchNorm1d(3, momentum=momentum)


def _stats(mean: list[float], var: list[float], count: float = 101.0) -> dict[str, torch.Tensor]:
    return {
        "bn.mean": torch.tensor(mean),
        "bn.var": torch.tensor(var),
        "bn.count": torch.tensor([count]),
    }


def _tracked_layer(momentum: float | None = 0.1) -> nn.BatchNorm1d:
    """A layer that has tracked one batch: mean (0.5, 0, −0.5), var (1, 0.25, 4), n = 101."""
    layer = _layer(momentum)
    stats = _stats([0.5, 0.0, -0.5], [1.0, 0.25, 4.0])
    apply_statistics(nn.Module(), stats, layers={"bn": layer}, checked=True)
    return layer


@pytest.mark.parametrize("momentum", [0.1, None])
def test_the_reference_removes_the_start_values(momentum: float | None) -> None:
    assert shadow_reference(_layer(momentum)) is None  # nothing tracked yet
    reference = shadow_reference(_tracked_layer(momentum))
    assert reference is not None
    mean, var = reference
    torch.testing.assert_close(mean, torch.tensor([0.5, 0.0, -0.5], dtype=torch.float64))
    # the running variance is unbiased: var · n / (n − 1)
    torch.testing.assert_close(
        var, torch.tensor([1.0, 0.25, 4.0], dtype=torch.float64) * 1.01, rtol=1e-6, atol=1e-7
    )


def test_a_forged_reply_far_from_the_shadow_is_clipped_to_the_bound() -> None:
    layer = _tracked_layer()
    eps = layer.eps
    honest = _stats([0.45, 0.1, -0.4], [1.1, 0.3, 3.5])
    forged = _stats([100.0, -100.0, 0.5], [0.0, 1e3, 4.04])
    honest_before = {k: v.clone() for k, v in honest.items()}
    reasons = bound_statistics_to_shadow({1: honest, 5: forged}, {"bn": layer}, K)
    assert set(reasons) == {5}
    assert "'bn.mean'" in reasons[5] and "shadow" in reasons[5]
    assert all(torch.equal(honest[k], honest_before[k]) for k in honest)
    var = [1.01, 0.2525, 4.04]
    want_mean = [0.5 + K * math.sqrt(var[0] + eps), 0.0 - K * math.sqrt(var[1] + eps), 0.5]
    want_var = [var[0] / K**2, K**2 * (var[1] + eps), 4.04]
    torch.testing.assert_close(forged["bn.mean"], torch.tensor(want_mean), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(forged["bn.var"], torch.tensor(want_var), rtol=1e-5, atol=1e-6)
    assert float(forged["bn.count"]) == 101.0  # left to the round bound
    assert bound_statistics_to_shadow({5: _stats([1e3] * 3, [0.0] * 3)}, {"bn": layer}, 0.0) == {}


def test_nothing_is_bounded_before_the_shadow_has_tracked_a_batch() -> None:
    forged = _stats([100.0, -100.0, 0.5], [0.0, 1e3, 4.04])
    before = {k: v.clone() for k, v in forged.items()}
    assert bound_statistics_to_shadow({5: forged}, {"bn": _layer()}, K) == {}
    assert all(torch.equal(forged[k], before[k]) for k in forged)


# ------------------------------------------------------------------ through the server
def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def _net_stats(mean: float, var: float) -> dict[str, torch.Tensor]:
    return {
        "1.mean": torch.full((3,), mean),
        "1.var": torch.full((3,), var),
        "1.count": torch.tensor([32.0]),
    }


def _reply(server: ReplicaServer, node: int, stats: dict[str, torch.Tensor]) -> ClientReply:
    model = server.shadow.model
    torch.manual_seed(node)
    grads = {n: 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
    version = server.shadow.version
    fingerprint = fingerprint_prefix(server.fingerprints[version]).hex()
    payload = encode_update(grads, IdentityCompressor())
    statistics = encode_update(stats, IdentityCompressor())
    return ClientReply(node, version, fingerprint, payload, 32, 1.0, None, statistics)


def _round(server: ReplicaServer, forged: dict[str, torch.Tensor]) -> None:
    server.plan_round(server.shadow.version + 1, NODES)
    replies = [
        _reply(server, n, forged if n == 5 else _net_stats(0.5 + 0.01 * n, 0.01)) for n in NODES
    ]
    server.aggregate(server.shadow.version + 1, replies)


def _statistics_clipped(server: ReplicaServer) -> list[int]:
    """The nodes whose statistics the last round clipped (gradient clips aside)."""
    return sorted(n for n, why in server.reports[-1].clipped.items() if "statistics" in why)


def test_the_server_clips_forged_statistics_from_the_second_round_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # under the round bound (|mean| 4 < 8 × 0.54), far from the shadow (σ ≈ 0.1)
    forged = _net_stats(-4.0, 0.0)
    server = ReplicaServer(_bn_net, compressor="identity", fp32_logits=False)
    bn = server.shadow.model.get_submodule("1")
    with caplog.at_level(logging.DEBUG, logger="fedddl"):
        _round(server, forged)  # first round: the shadow holds BatchNorm's start values
        assert not _statistics_clipped(server), server.reports[-1].clipped
        for _ in range(2):
            _round(server, forged)
            report = server.reports[-1]
            assert _statistics_clipped(server) == [5], report.clipped  # honest untouched
            assert "shadow's bound" in report.clipped[5] and 5 in report.accepted
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "shadow's bound" in r.message
    ]
    assert len(warnings) == 1 and "node 5" in warnings[0].message
    assert bool(torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all())
    reference = shadow_reference(bn)
    assert reference is not None
    mean, var = reference  # the pooled medians: the honest means 0.51-0.54, variances ~0.01
    assert float(mean.min()) > 0.5 and float(mean.max()) < 0.55
    assert float(var.min()) > 0.005 and float(var.max()) < 0.02


def test_statistics_bound_zero_turns_it_off() -> None:
    server = ReplicaServer(
        _bn_net,
        compressor="identity",
        fp32_logits=False,
        defenses=Defenses(statistics_bound=0.0),
    )
    for _ in range(2):
        _round(server, _net_stats(-4.0, 0.0))
    assert not _statistics_clipped(server), server.reports[-1].clipped


def test_statistics_bound_is_validated_and_a_run_config_key() -> None:
    with pytest.raises(ValueError, match="statistics-bound"):
        Defenses(statistics_bound=0.5)
    assert AppConfig().defenses().statistics_bound == 4.0
    assert AppConfig.from_run_config({"statistics-bound": 0}).defenses().statistics_bound == 0.0
    with pytest.raises(ValueError, match="statistics-bound"):
        AppConfig.from_run_config({"statistics-bound": 0.5})
