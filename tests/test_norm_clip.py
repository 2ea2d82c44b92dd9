"""Norm clipping to the round's median norm (``norm-clip``)."""

from __future__ import annotations

import logging

import pytest
import torch

from fedddl.app_config import AppConfig
from fedddl.compression import IdentityCompressor, encode_update
from fedddl.sync import ReplicaServer
from fedddl.sync.aggregation import Contribution
from fedddl.sync.messages import ClientReply, fingerprint_prefix
from fedddl.sync.norm_clip import NormClip


def _contribution(node: int, values: torch.Tensor, scale: float | None = None) -> Contribution:
    reply = ClientReply(node, 0, "00" * 8, b"", 32, 1.0)
    scales = None if scale is None else {"w": scale}
    return Contribution(reply, {"w": values, "b": torch.ones(2)}, scales=scales)


def test_a_reply_over_the_median_norm_is_scaled_down_to_it() -> None:
    clip = NormClip(1.0)
    parts = [_contribution(n, torch.full((4,), 1 + 0.1 * n), scale=1 + 0.1 * n) for n in range(5)]
    parts.append(_contribution(9, torch.full((4,), -8.0), scale=8.0))
    out = list(clip.filter(parts))
    norms = [float(c.gradient["w"].norm()) for c in out]
    median = float(torch.full((4,), 1.2).norm())  # lower median of the six norms
    assert norms[-1] == pytest.approx(median)
    assert float(out[-1].gradient["w"][0]) < 0  # direction kept
    assert out[-1].scales is not None
    assert out[-1].scales["w"] == pytest.approx(1.2)
    assert set(clip.clipped) == {3, 4, 9} and "w x" in clip.clipped[9]
    assert "b" not in clip.clipped[9]  # equal norms: not clipped
    assert float(parts[-1].gradient["w"][0]) == -8.0  # the inputs are copied, not changed


def test_off_or_too_few_replies_change_nothing() -> None:
    parts = [_contribution(n, torch.full((4,), float(n + 1))) for n in range(2)]
    assert [c.gradient for c in NormClip(0.0).filter(parts)] == [c.gradient for c in parts]
    assert all(
        torch.equal(a.gradient["w"], b.gradient["w"])
        for a, b in zip(NormClip(1.0).filter(parts), parts, strict=True)
    )


def test_the_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="norm-clip"):
        NormClip(0.5)
    with pytest.raises(ValueError, match="norm-clip"):
        AppConfig.from_run_config({"norm-clip": 0.5}).defenses()
    assert AppConfig.from_run_config({"norm-clip": 2}).defenses().norm_clip == 2.0


def test_the_server_lists_and_logs_a_clipped_reply_once(caplog: pytest.LogCaptureFixture) -> None:
    from fedddl.defenses import Defenses

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)

    server = ReplicaServer(
        net, compressor="identity", fp32_logits=False,
        defenses=Defenses(norm_clip=1.0, direction_check=0.0, scale_bound=0.0),
    )  # fmt: skip
    nodes = (1, 2, 3, 4)
    for _ in range(2):
        version = server.shadow.version
        server.plan_round(version + 1, nodes)
        fingerprint = fingerprint_prefix(server.fingerprints[version]).hex()
        replies = []
        for node in nodes:
            size = 5.0 if node == 4 else 0.01 * node
            grads = {n: torch.full_like(p, size) for n, p in server.shadow.model.named_parameters()}
            payload = encode_update(grads, IdentityCompressor())
            replies.append(ClientReply(node, version, fingerprint, payload, 32, 1.0))
        with caplog.at_level(logging.WARNING, logger="fedddl"):
            report = server.aggregate(version + 1, replies)
        assert 4 in report.clipped and "median" in report.clipped[4]
        assert report.accepted == list(nodes)
    assert sum("clipping reply" in r.message and "node 4" in r.message for r in caplog.records) == 1


def test_the_server_clips_by_default_but_not_with_exact_code_sums() -> None:
    def net() -> torch.nn.Module:
        return torch.nn.Linear(4, 2)

    assert ReplicaServer(net).norm_clip.factor == 1.5
    assert not ReplicaServer(net, downlink="shared-scale-sum").norm_clip.enabled
