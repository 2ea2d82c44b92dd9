"""Tests of the gossip partner schedulers and merging."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from fedddl.gossip import (
    CommTimeEstimator,
    CommunicationScheduler,
    PeerState,
    RandomScheduler,
    get_scheduler,
    merge_models,
    version_weight,
)


def _states(enabled: dict[int, bool], version: int = 0) -> dict[int, PeerState]:
    return {i: PeerState(i, on, version) for i, on in enabled.items()}


def _estimator(times: dict[int, float], size: int) -> CommTimeEstimator:
    est = CommTimeEstimator()
    for peer, t in times.items():
        est.observe(peer, size, t)
    return est


def test_scheduled_picks_fastest_enabled_peer() -> None:
    size = 1000
    est = _estimator({1: 0.5, 2: 0.1, 3: 0.3, 4: 0.05}, size)
    peers = _states({0: True, 1: True, 2: True, 3: True, 4: False})
    rng = np.random.default_rng(0)
    sched = CommunicationScheduler(selection="fastest")
    picks = {sched.choose_peer(0, peers, size, est, rng) for _ in range(50)}
    assert picks == {2}  # 4 is faster but disabled


def test_scheduled_never_picks_disabled_or_self() -> None:
    rng = np.random.default_rng(1)
    sched = CommunicationScheduler()
    est = CommTimeEstimator()
    for _ in range(200):
        flags = {i: bool(rng.integers(2)) for i in range(6)}
        choice = sched.choose_peer(0, _states(flags), 100, est, rng)
        if choice is None:
            assert not any(on for i, on in flags.items() if i != 0)
        else:
            assert choice != 0 and flags[choice]


def test_scheduled_spreads_ties() -> None:
    peers = _states({i: True for i in range(5)})
    rng = np.random.default_rng(2)
    counts = collections.Counter(
        CommunicationScheduler().choose_peer(0, peers, 10, CommTimeEstimator(), rng)
        for _ in range(400)
    )
    assert set(counts) == {1, 2, 3, 4}
    assert min(counts.values()) > 60


def test_scheduled_skips_peer_that_would_be_far_ahead() -> None:
    size = 1000
    est = _estimator({1: 0.1, 2: 1.0}, size)
    peers = {
        0: PeerState(0, True, 100),
        1: PeerState(1, True, 150, steps_per_s=10.0),  # lag 51 steps: stale
        2: PeerState(2, True, 100, steps_per_s=5.0),  # lag 5 steps: fine
    }
    sched = CommunicationScheduler(stale_threshold_steps=10)
    assert sched.choose_peer(0, peers, size, est, np.random.default_rng(0)) == 2
    peers[2] = PeerState(2, True, 100, steps_per_s=20.0)  # lag 20 steps: stale too
    assert sched.choose_peer(0, peers, size, est, np.random.default_rng(0)) is None


def test_scheduled_uses_peer_shared_estimate_when_unobserved() -> None:
    peers = {
        0: PeerState(0, True, 0),
        1: PeerState(1, True, 0, {0: 2.0}),
        2: PeerState(2, True, 0, {0: 0.01}),
    }
    choice = CommunicationScheduler(selection="fastest").choose_peer(
        0, peers, 10, CommTimeEstimator(), np.random.default_rng(0)
    )
    assert choice == 2


def test_random_scheduler_is_uniform_and_seeded() -> None:
    peers = _states({i: i % 2 == 0 for i in range(5)})  # enabled flags are ignored
    est = CommTimeEstimator()

    def draw(seed: int) -> list[int | None]:
        rng = np.random.default_rng(seed)
        return [RandomScheduler().choose_peer(0, peers, 10, est, rng) for _ in range(2000)]

    picks = draw(7)
    assert picks == draw(7)
    assert picks != draw(8)
    counts = collections.Counter(picks)
    assert set(counts) == {1, 2, 3, 4}
    assert all(abs(c - 500) < 90 for c in counts.values())  # ~4 sigma


def test_get_scheduler() -> None:
    assert isinstance(get_scheduler("random"), RandomScheduler)
    sched = get_scheduler("scheduled", stale_threshold_steps=3)
    assert isinstance(sched, CommunicationScheduler) and sched.stale_threshold_steps == 3
    with pytest.raises(ValueError, match="unknown scheduler 'nope'"):
        get_scheduler("nope")


def test_peer_state_round_trip() -> None:
    state = PeerState(3, True, 42, {0: 0.5, 7: 1.25}, steps_per_s=20.0)
    data = state.to_bytes()
    assert len(data) == PeerState.message_size(2)
    assert PeerState.from_bytes(data) == state
    with pytest.raises(ValueError, match="status message"):
        PeerState.from_bytes(data[:-1])


def test_merge_is_exact_average() -> None:
    gen = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(4, 3, generator=gen), "n": torch.tensor(3)}
    b = {"w": torch.randn(4, 3, generator=gen), "n": torch.tensor(5)}
    a_before = a["w"].clone()
    merged = merge_models(a, b)
    torch.testing.assert_close(merged["w"], (a["w"] + b["w"]) / 2)
    assert int(merged["n"]) == 5
    torch.testing.assert_close(a["w"], a_before)  # input untouched
    torch.testing.assert_close(merge_models(a, b, 0.25)["w"], 0.75 * a["w"] + 0.25 * b["w"])


def test_merge_rejects_mismatch() -> None:
    a = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="names"):
        merge_models(a, {"v": torch.zeros(2)})
    with pytest.raises(ValueError, match="'w'"):
        merge_models(a, {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="weight"):
        merge_models(a, a, 1.5)


def test_version_weight() -> None:
    assert version_weight(0, 0) == 0.5
    assert version_weight(30, 10) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="versions"):
        version_weight(-1, 2)


def test_proportional_selection_follows_inverse_time() -> None:
    size = 1000
    est = _estimator({1: 0.1, 2: 0.3, 3: 0.05}, size)
    peers = _states({0: True, 1: True, 2: True, 3: False})
    sched = CommunicationScheduler(selection="proportional")
    rng = np.random.default_rng(5)
    counts = collections.Counter(sched.choose_peer(0, peers, size, est, rng) for _ in range(4000))
    assert set(counts) == {1, 2}  # 3 is disabled
    # P(1) = (1/0.1) / (1/0.1 + 1/0.3) = 0.75
    assert abs(counts[1] / 4000 - 0.75) < 0.03
    with pytest.raises(ValueError, match="selection"):
        CommunicationScheduler(selection="best")
