"""Clipped gossip: a neighbour's difference is bounded relative to the node's own model."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fedddl.gossip.attack import GOSSIP_ATTACKS, poison_state
from fedddl.gossip.clip import DEFAULT_CLIP, MergeClip, clip_level, state_norm
from fedddl.models import create_model
from tests.support.gossip_nodes import make_node, model_frame, raw_send


def _vec(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values, dtype=torch.float32)}


def test_warm_up_bound_is_the_own_drift_from_the_initial_model() -> None:
    clip = MergeClip(2.0, _vec(0.0, 0.0), min_voters=3)
    own = _vec(3.0, 4.0)  # drift 5: tau = 10
    assert clip.bound(own) == (10.0, True)
    small = clip.clip(1, _vec(6.0, 8.0), own)  # norm 10: not above tau
    assert small.reason is None and torch.equal(small.update["w"], torch.tensor([6.0, 8.0]))
    big = clip.clip(2, _vec(12.0, 16.0), own)  # norm 20 -> 10
    assert big.reason == "clip-warm-up" and big.bound == 10.0
    assert state_norm(big.update) == pytest.approx(10.0)
    assert torch.allclose(big.update["w"], torch.tensor([6.0, 8.0]))
    far = clip.clip(3, _vec(30.0, 40.0), own)  # norm 50 > 5 x the drift of 5
    assert far.reason == "clip-far" and state_norm(far.update) == pytest.approx(10.0)
    # Before any step the bound is 0: nothing gets merged, and it is no "far" outlier.
    fresh = MergeClip(2.0, _vec(0.0, 0.0))
    zero = fresh.clip(1, _vec(1.0, 0.0), _vec(0.0, 0.0))
    assert zero.reason == "clip-warm-up" and float(zero.update["w"].abs().sum()) == 0.0


def test_the_median_of_one_vote_per_peer_bounds_an_outlier() -> None:
    clip = MergeClip(2.0, _vec(0.0), min_voters=3)
    for peer, norm in ((1, 1.0), (2, 2.0), (3, 3.0)):
        clip.clip(peer, _vec(norm), _vec(100.0))
    assert clip.bound() == (4.0, False)  # 2 * median(1, 2, 3)
    attacker = 7
    first = clip.clip(attacker, _vec(999.0))
    assert first.reason == "clip-far" and first.update["w"].item() == pytest.approx(4.0)
    for _ in range(50):  # a flood of huge differences is still one vote
        outcome = clip.clip(attacker, _vec(999.0))
        assert outcome.reason == "clip-far" and outcome.update["w"].item() == pytest.approx(5.0)
    assert clip.bound() == (5.0, False)  # 2 * median(1, 2, 3, 999)
    assert clip.votes()[attacker] == 999.0


def test_a_scaled_update_is_judged_by_its_difference() -> None:
    clip = MergeClip(1.0, _vec(0.0), min_voters=1)
    clip.clip(1, _vec(2.0))  # vote 2
    # 0.25 * difference 8: the difference is over tau = 2, so the update becomes 0.25 * 2.
    outcome = clip.clip(2, _vec(2.0), scale=0.25)
    assert outcome.norm == 8.0 and outcome.reason == "clip"
    assert outcome.update["w"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        clip.clip(1, _vec(1.0), scale=0.0)
    with pytest.raises(ValueError):
        MergeClip(0.0, _vec(0.0))
    assert clip_level("clip-far") == logging.WARNING and clip_level("clip") == logging.INFO


def test_non_finite_differences_are_never_applied() -> None:
    clip = MergeClip(1.0, _vec(0.0), min_voters=1)
    outcome = clip.clip(1, _vec(math.nan))
    assert outcome.reason == "clip-far" and outcome.update["w"].item() == 0.0
    assert clip.votes() == {}


def test_poison_kinds_stay_in_bound_and_keep_counters() -> None:
    model = create_model("digits", seed=0)
    initial = model.state_dict()
    own = {k: v + 0.5 for k, v in initial.items()}
    for kind, scale in GOSSIP_ATTACKS.items():
        poisoned = poison_state(kind, own, initial)
        assert set(poisoned) == set(own)
        largest = max(float(v.abs().max()) for v in poisoned.values())
        assert 0 < largest < 1000.0, kind
        first = next(iter(own))
        expected = {"constant": torch.full_like(own[first], scale),
                    "scaled-initial": initial[first] * scale,
                    "sign-flip": own[first] * scale}[kind]
        assert torch.equal(poisoned[first], expected)
    with pytest.raises(ValueError, match="unknown gossip attack"):
        poison_state("nope", own, initial)


def test_a_peer_clips_a_poisoned_model_and_counts_it_once_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = make_node(0, clip=DEFAULT_CLIP)
    node.serve()
    node.set_peers({1: "127.0.0.1:1", 2: "127.0.0.1:1", 3: "127.0.0.1:1"})
    node.start_training(run_threads=False)
    caplog.set_level(logging.INFO, logger="fedddl")
    try:
        base = create_model("digits", seed=0).state_dict()
        with torch.no_grad():  # the node has moved away from the initial model
            for p in node.model.parameters():
                p.add_(0.01)
        own = {k: v.clone() for k, v in node.model.state_dict().items()}
        honest = {k: v + 0.02 for k, v in own.items()}
        for peer in (1, 2):
            assert raw_send(node.server.address, model_frame(honest, peer))[0].name == "OK"
            node.merge_pending()
        poison = poison_state("constant", own, base)
        for _ in range(3):
            assert raw_send(node.server.address, model_frame(poison, 3))[0].name == "OK"
            before = {k: v.clone() for k, v in node.model.state_dict().items()}
            assert node.merge_pending() == 1
            after = node.model.state_dict()
            moved = state_norm({k: after[k] - before[k] for k in before})
            assert node.clip is not None
            tau, _ = node.clip.bound()
            assert 0 < moved <= 0.5 * tau * 1.001  # weight 0.5 of at most tau
        metrics = node.metrics()
        assert metrics["clipped"]["node 3"] == {"clip-far": 3}
        assert metrics["clip_bound"] is not None and metrics["rejected"] == {}
        far = [r for r in caplog.records if "clipped frame from node 3" in r.getMessage()]
        assert len(far) == 1 and far[0].levelno == logging.WARNING
    finally:
        node.stop(grace_s=0)


def test_two_votes_never_replace_the_drift_bound() -> None:
    clip = MergeClip(0.25, _vec(0.0, 0.0))
    own = _vec(3.0, 4.0)  # drift 5
    clip.clip(1, _vec(1.0, 0.0), own)
    clip.clip(2, _vec(900.0, 0.0), own)  # with two voters, one attacker would be half
    assert clip.warming_up and clip.bound(own) == (1.25, True)
    assert state_norm(clip.clip(2, _vec(900.0, 0.0), own).update) == pytest.approx(1.25)


@pytest.mark.parametrize("compressor", ["", "ternary-base3"])
def test_real_peers_bound_a_compromised_peer(compressor: str) -> None:
    from tests.support.gossip_nodes import run_to_completion

    def honest_largest_weight(clip: float) -> tuple[float, dict[str, int]]:
        nodes = [
            make_node(i, steps=100, min_step_s=0.005, compressor=compressor, clip=clip,
                      attack="constant" if i == 3 else "")
            for i in range(4)
        ]
        assert run_to_completion(nodes, timeout_s=60)
        largest = max(float(v.abs().max()) for n in nodes[:3]
                      for v in n.model.state_dict().values() if v.is_floating_point())
        clipped: dict[str, int] = {}
        for n in nodes[:3]:
            for reason, count in n.metrics()["clipped"].get("node 3", {}).items():
                clipped[reason] = clipped.get(reason, 0) + count
        return largest, clipped

    # Clean, the honest weights stay below 0.5 here; the poison is 999 everywhere.
    largest, clipped = honest_largest_weight(DEFAULT_CLIP)
    assert largest < 1.0 and clipped.get("clip-far", 0) > 0, (largest, clipped)
    unclipped, none = honest_largest_weight(0.0)
    assert unclipped > 2.5 and none == {}  # the poison gets in without the clip
