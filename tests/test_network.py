"""Tests of the network model and the link busy-tracker."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedddl.network import (
    MBIT,
    BandwidthTrace,
    LinkScheduler,
    NetworkError,
    NetworkModel,
    load_network,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "simulations" / "networks"


def test_homogeneous_transfer_time_by_hand() -> None:
    net = NetworkModel.homogeneous(4, latency_s=0.05, bandwidth_Bps=100 * MBIT)
    # 1 MB at 12.5 MB/s = 0.08 s, plus 50 ms.
    assert net.transfer_time(0, 3, 1_000_000) == pytest.approx(0.13)
    assert net.transfer_time(2, 1, 0) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="itself"):
        net.transfer_time(1, 1, 10)
    with pytest.raises(ValueError, match="outside"):
        net.transfer_time(0, 4, 10)


def test_heterogeneous_regions_and_slow_uplinks() -> None:
    net = NetworkModel.heterogeneous(16, num_regions=4, slow_uplink_fraction=0.25, seed=3)
    assert net.num_nodes == 16
    # nodes 0 and 1 share region 0; 0 and 4 do not
    assert net.latency_s[0, 1] == 0.01 and net.latency_s[0, 4] == 0.15
    slow = [i for i in range(16) if net.bandwidth_Bps[i, (i + 1) % 16] == 10 * MBIT]
    assert len(slow) == 4
    for i in slow:
        assert np.all(np.delete(net.bandwidth_Bps[i], i) <= 10 * MBIT)
    fast = next(i for i in range(16) if i not in slow and (i ^ 1) not in slow)
    assert net.bandwidth_Bps[fast, fast ^ 1] == 1000 * MBIT
    assert net.transfer_time(0, 8, 2_500_000) > net.transfer_time(0, 1, 2_500_000)


def test_busy_uplink_queues_next_send() -> None:
    net = NetworkModel.homogeneous(3, latency_s=0.1, bandwidth_Bps=1000.0)
    links = LinkScheduler(net)
    first = links.reserve(0, 1, 400, ready_s=1.0)  # 0.1 + 0.4
    assert first.start_s == 1.0
    assert first.end_s == pytest.approx(1.5)
    second = links.reserve(0, 2, 100, ready_s=1.2)  # waits for uplink of 0
    assert second.start_s == pytest.approx(1.5)
    assert second.end_s == pytest.approx(1.7)
    assert links.uplink_busy(0, 1.6) and not links.uplink_busy(0, 1.7)
    # downlink of 1 busy until 1.5: a send 2 -> 1 at 1.1 queues, another from 2 -> 0 does not
    third = links.reserve(2, 1, 0, ready_s=1.1)
    assert third.start_s == pytest.approx(1.5)
    assert third.duration_s == pytest.approx(0.1)


def test_downlink_free_during_latency_lets_transfers_overlap_in_flight() -> None:
    net = NetworkModel.homogeneous(3, latency_s=0.1, bandwidth_Bps=1000.0)
    held = LinkScheduler(net)
    free = LinkScheduler(net, downlink_holds_latency=False)
    for links in (held, free):
        first = links.reserve(0, 1, 400, ready_s=1.0)  # bytes arrive in [1.1, 1.5)
        assert first.end_s == pytest.approx(1.5)
    # 2 -> 1 at 1.1: held waits for 1.5; free may start at 1.4 (first byte at 1.5).
    assert held.reserve(2, 1, 100, ready_s=1.1).start_s == pytest.approx(1.5)
    late = free.reserve(2, 1, 100, ready_s=1.1)
    assert late.start_s == pytest.approx(1.4)
    assert late.end_s == pytest.approx(1.6)
    assert free.downlink_free_at(1) == pytest.approx(1.6)
    # The uplink is still held for latency + bytes: one send at a time per node.
    assert free.reserve(0, 2, 100, ready_s=1.2).start_s == pytest.approx(1.5)


def test_uplink_only_mode_ignores_receiver() -> None:
    net = NetworkModel.homogeneous(3, latency_s=0.0, bandwidth_Bps=10.0)
    links = LinkScheduler(net, downlink_contention=False)
    links.reserve(0, 2, 10, ready_s=0.0)
    assert links.reserve(1, 2, 10, ready_s=0.0).start_s == 0.0


def test_time_varying_trace_by_hand() -> None:
    trace = BandwidthTrace((0.0, 10.0, 20.0), (1.0, 0.5, 2.0))
    assert trace.multiplier(5) == 1.0 and trace.multiplier(10) == 0.5 and trace.multiplier(99) == 2
    net = NetworkModel(
        [[0, 0.2], [0.2, 0]], [[0, 100.0], [100.0, 0]], trace=trace, node_traces=None
    )
    # start 8 s, 1000 B: 200 B in [8, 10) at 100 B/s, 500 B in [10, 20) at 50 B/s,
    # 300 B at 200 B/s = 1.5 s -> serialisation 13.5 s, plus latency.
    assert net.transfer_time(0, 1, 1000, start_time=8.0) == pytest.approx(0.2 + 13.5)
    assert net.transfer_time(0, 1, 100, start_time=0.0) == pytest.approx(0.2 + 1.0)


def test_node_trace_multiplies_global_trace() -> None:
    glob = BandwidthTrace((0.0,), (0.5,))
    node = BandwidthTrace((0.0, 1.0), (1.0, 0.1))
    net = NetworkModel(
        np.zeros((2, 2)), np.full((2, 2), 100.0), trace=glob, node_traces={1: node}
    )
    assert net.transfer_time(0, 1, 100, 0.0) == pytest.approx(2.0)
    # node 1: 50 B/s for 1 s, then 5 B/s: 100 B -> 1 + 50 / 5 = 11 s
    assert net.transfer_time(1, 0, 100, 0.0) == pytest.approx(11.0)


def test_example_files_load() -> None:
    two = load_network(EXAMPLES / "two-sites.json", 4)
    assert two.name == "two-sites" and two.trace is not None
    assert two.transfer_time(3, 0, 1_250_000) == pytest.approx(0.12 + 1.0)
    wan = load_network(EXAMPLES / "wan16.json", 16)
    assert wan.latency_s[0, 15] == 0.2
    lan = NetworkModel.from_file(EXAMPLES / "lan8.toml")
    assert lan.num_nodes == 8 and lan.transfer_time(0, 7, 125_000) == pytest.approx(0.002)


def test_round_trip_through_dict(tmp_path: Path) -> None:
    net = NetworkModel.heterogeneous(6, num_regions=2, seed=1)
    path = tmp_path / "net.json"
    path.write_text(json.dumps(net.to_dict()))
    again = NetworkModel.from_file(path)
    np.testing.assert_array_equal(again.bandwidth_Bps, net.bandwidth_Bps)
    np.testing.assert_array_equal(again.latency_s, net.latency_s)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"latency_s": [[0, 1, 2], [1, 0, 1]], "bandwidth_Bps": [[0, 1], [1, 0]]}, "square"),
        ({"latency_s": [[0, 1], [1, 0]], "bandwidth_Bps": [[0, 0], [1, 0]]}, r"\[0\]\[1\]"),
        ({"latency_s": [[0, -1], [1, 0]], "bandwidth_Bps": [[0, 1], [1, 0]]}, "negative"),
        ({"latency_s": [[0, 1], [1, 0]], "bandwidth_Bps": [[0, 1, 1]] * 3}, "3x3"),
        ({"latency_s": [[0, 1], [1, 0]]}, "bandwidth_Bps"),
        ({"latency_s": [[0, "x"], [1, 0]], "bandwidth_Bps": [[0, 1], [1, 0]]}, "numbers"),
        ({"latency_s": [[0, 1], [1, 0]], "bandwidth_Bps": [[0, 1], [1, 0]], "x": 1}, "'x'"),
        (
            {
                "latency_s": [[0, 1], [1, 0]],
                "bandwidth_Bps": [[0, 1], [1, 0]],
                "trace": {"times_s": [1, 2], "multipliers": [1, 1]},
            },
            "start at 0",
        ),
        (
            {
                "latency_s": [[0, 1], [1, 0]],
                "bandwidth_Bps": [[0, 1], [1, 0]],
                "trace": {"times_s": [0, 2], "multipliers": [1, 0]},
            },
            "> 0",
        ),
        (
            {
                "latency_s": [[0, 1], [1, 0]],
                "bandwidth_Bps": [[0, 1], [1, 0]],
                "node_traces": {"5": {"times_s": [0], "multipliers": [1]}},
            },
            "node 5",
        ),
        ({"profile": "mesh"}, "unknown profile"),
        ({"profile": "homogeneous", "num_nodes": 4, "speed": 3}, "speed"),
    ],
)
def test_invalid_descriptions_raise_clear_errors(data: dict[str, object], match: str) -> None:
    with pytest.raises(NetworkError, match=match):
        NetworkModel.from_dict(data)


def test_load_network_errors(tmp_path: Path) -> None:
    with pytest.raises(NetworkError, match="neither a profile"):
        load_network("nowhere.json", 4)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(NetworkError, match="not valid json"):
        load_network(bad, 4)
    with pytest.raises(NetworkError, match="describes 4 nodes, but 5"):
        load_network(EXAMPLES / "two-sites.json", 5)
    assert load_network("homogeneous", 5).num_nodes == 5
    assert load_network("heterogeneous", 8).name == "heterogeneous"
