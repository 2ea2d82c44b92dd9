"""Bounded influence of one peer, even a known one: rate, clock jumps, weight range.

The attacks are those of the issue that motivated the limits: frames with all
weights 1e6, a clock of 10**15 with ``--merge version``, and a flood of frames.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest
import torch

from fedddl.gossip.admission import AdmissionLimits, TokenBucket
from fedddl.gossip.peer_node import PeerNode
from fedddl.models import create_model
from tests.support.gossip_nodes import make_node, model_frame, raw_send


def _serving(node: PeerNode) -> PeerNode:
    node.serve()
    node.set_peers({1: "127.0.0.1:1", 2: "127.0.0.1:1"})  # known senders; never dialled
    node.start_training(run_threads=False)
    return node


@pytest.fixture()
def strict() -> Iterator[PeerNode]:
    """Node 0: 3 model frames of burst, refilled at one frame per 100 s; clocks +/- 100."""
    limits = AdmissionLimits(max_model_rate=0.01, model_burst=3, max_version_jump=100,
                             max_abs_weight=50.0)
    # Unclipped: these tests are about admission; a node that never stepped clips every
    # merge to nothing (test_gossip_clip.py).
    node = _serving(make_node(0, merge="version", limits=limits, clip=0.0))
    yield node
    node.stop(grace_s=0)


def _weights(shift: float = 0.0, seed: int = 1) -> dict[str, torch.Tensor]:
    return {k: v + shift for k, v in create_model("digits", seed=seed).state_dict().items()}


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=2.0, burst=3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    now[0] = 0.5  # one token back
    assert [bucket.take() for _ in range(2)] == [True, False]
    now[0] = 100.0  # never more than the burst
    assert sum(bucket.take() for _ in range(10)) == 3
    with pytest.raises(ValueError):
        TokenBucket(rate=0.0, burst=1)
    with pytest.raises(ValueError, match="max_model_rate"):
        AdmissionLimits(max_model_rate=-1.0)


def test_a_flood_of_model_frames_is_cut_to_the_rate_and_logged_once(
    strict: PeerNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedddl")
    codes = [raw_send(strict.server.address, model_frame(_weights(), 1))[0] for _ in range(8)]
    assert codes == [grpc.StatusCode.OK] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 5
    # Another peer has its own budget.
    assert raw_send(strict.server.address, model_frame(_weights(), 2))[0] == grpc.StatusCode.OK
    metrics = strict.metrics()
    assert metrics["rejected"] == {"RESOURCE_EXHAUSTED": 5}
    assert metrics["rejections"] == {"node 1": {"rate-limit": 5}}
    assert metrics["received_from"] == {"1": 3, "2": 1}
    lines = [r.getMessage() for r in caplog.records if "rejected frame" in r.getMessage()]
    assert len(lines) == 1 and "rate limit" in lines[0] and "node 1" in lines[0], lines


def test_out_of_range_weights_are_refused_and_the_model_is_untouched(strict: PeerNode) -> None:
    before = strict.fingerprint()
    address = strict.server.address
    huge = raw_send(address, model_frame(_weights(1e6), 1))
    assert huge[0] == grpc.StatusCode.INVALID_ARGUMENT and "|w| = 1e+06 > 50" in huge[1]
    negative = raw_send(address, model_frame(_weights(-60.0), 1))
    assert negative[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert strict.merge_pending() == 0 and strict.fingerprint() == before
    assert strict.metrics()["rejections"] == {"node 1": {"weight-range": 2}}
    # A model inside the range is merged (the bound is not "refuse everything").
    assert raw_send(address, model_frame(_weights(10.0), 1))[0] == grpc.StatusCode.OK
    assert strict.merge_pending() == 1 and strict.fingerprint() != before


def test_a_clock_may_not_jump_past_the_bound(strict: PeerNode) -> None:
    address = strict.server.address
    refused = raw_send(address, model_frame(_weights(), 1, version=10**15))
    assert refused[0] == grpc.StatusCode.INVALID_ARGUMENT and "jumps past 100" in refused[1]
    assert strict.merge_pending() == 0 and strict.metrics()["model_version"] == 0
    # Within the bound of the highest clock seen, the clock moves on, and the bound with it.
    assert raw_send(address, model_frame(_weights(), 1, version=90))[0] == grpc.StatusCode.OK
    assert strict.merge_pending() == 1 and strict.metrics()["model_version"] == 90
    assert raw_send(address, model_frame(_weights(), 2, version=191))[0] == (
        grpc.StatusCode.INVALID_ARGUMENT)
    assert raw_send(address, model_frame(_weights(), 2, version=185))[0] == grpc.StatusCode.OK
    strict.merge_pending()
    assert strict.metrics()["model_version"] == 185
    assert strict.metrics()["rejections"] == {
        "node 1": {"version-jump": 1}, "node 2": {"version-jump": 1}}
