"""Tests of the transfer-time estimator."""

from __future__ import annotations

import pytest

from fedddl.gossip.estimator import CommTimeEstimator


def test_unobserved_peer_uses_prior() -> None:
    est = CommTimeEstimator(prior_latency_s=0.1, prior_bandwidth_Bps=1e6)
    assert est.estimate(3, 500_000) == pytest.approx(0.1 + 0.5)
    assert not est.observed(3)


def test_converges_to_true_time_for_fixed_size() -> None:
    true_time = 0.02 + 40_000 / 2e5  # 20 ms + 0.2 s
    est = CommTimeEstimator(alpha=0.3)
    for _ in range(30):
        est.observe(1, 40_000, true_time)
    assert est.observed(1)
    assert est.estimate(1, 40_000) == pytest.approx(true_time, rel=1e-9)


def test_tracks_a_change_of_bandwidth() -> None:
    est = CommTimeEstimator(alpha=0.3)
    for _ in range(10):
        est.observe(0, 1000, 1.0)
    for _ in range(40):
        est.observe(0, 1000, 3.0)
    assert est.estimate(0, 1000) == pytest.approx(3.0, rel=1e-4)


def test_separates_latency_and_bandwidth_with_varied_sizes() -> None:
    latency, bandwidth = 0.07, 3e6
    est = CommTimeEstimator(alpha=0.2)
    for i in range(60):
        size = 10_000 + (i % 5) * 200_000
        est.observe(2, size, latency + size / bandwidth)
    lat, bw = est.snapshot()[2]
    assert lat == pytest.approx(latency, rel=1e-6)
    assert bw == pytest.approx(bandwidth, rel=1e-6)
    assert est.estimate(2, 5_000_000) == pytest.approx(latency + 5_000_000 / bandwidth, rel=1e-6)


def test_set_prior_and_snapshot() -> None:
    est = CommTimeEstimator()
    est.set_prior(4, 0.2, 1e5)
    assert list(est.snapshot()) == [4]
    latency, bandwidth = est.snapshot()[4]
    assert latency == 0.2
    assert bandwidth == pytest.approx(1e5)
    assert est.estimate(4, 100_000) == pytest.approx(1.2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"prior_latency_s": -1.0}, "latency"),
        ({"prior_bandwidth_Bps": 0.0}, "bandwidth"),
    ],
)
def test_rejects_bad_parameters(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CommTimeEstimator(**kwargs)  # type: ignore[arg-type]


def test_rejects_bad_observation() -> None:
    est = CommTimeEstimator()
    with pytest.raises(ValueError, match="seconds"):
        est.observe(0, 10, -1.0)
    with pytest.raises(ValueError, match="num_bytes"):
        est.observe(0, -1, 1.0)
