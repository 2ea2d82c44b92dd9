"""The testbed's activity samples: a round's transfer spans and CPU use."""

from __future__ import annotations

import pytest

from fedddl.testbed.activity import (
    ActivitySampler,
    _busy_cpu_s,
    _port_bytes,
    round_activity,
    rounds_activity,
)


def _samples(cpu_rate: list[float], node_rates: list[list[tuple[float, float]]],
             t0: float = 1000.0, dt: float = 0.5) -> list[list[float]]:
    """Cumulative rows from per-interval rates: node_rates[node][i] = (sent/s, received/s)."""
    rows, busy = [], 0.0
    sent = [0.0] * len(node_rates)
    got = [0.0] * len(node_rates)
    for i in range(len(cpu_rate) + 1):
        rows.append([t0 + i * dt, busy] + [v for n in range(len(node_rates))
                                            for v in (sent[n], got[n])])
        if i < len(cpu_rate):
            busy += cpu_rate[i] * dt
            for n, rates in enumerate(node_rates):
                sent[n] += rates[i][0] * dt
                got[n] += rates[i][1] * dt
    return rows


def test_spans_of_staggered_downloads_and_cpu_use_during_them() -> None:
    # 8 intervals of 0.5 s; node 0 downloads in 0-1, node 1 in 2-3; both upload in 6;
    # ACK-sized traffic (1 % of the peak) in the other direction stays out of the spans.
    node0 = [(1e4, 1e6), (1e4, 1e6), (0, 0), (0, 0), (0, 0), (0, 0), (1e6, 1e4), (0, 0)]
    node1 = [(0, 0), (0, 0), (1e4, 1e6), (1e4, 1e6), (0, 0), (0, 0), (1e6, 1e4), (0, 0)]
    cpu = [1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.5]
    rows = _samples(cpu, [node0, node1])
    out = round_activity(rows, 1000.0, 1004.0)
    assert out["download"][0] == pytest.approx({"start_s": 0.0, "end_s": 1.0, "busy_s": 1.0,
                                                "bytes": 1e6 + 1e4 * 0.5})
    assert out["download"][1]["start_s"] == pytest.approx(1.0)
    assert out["download"][1]["end_s"] == pytest.approx(2.0)
    assert out["upload"][0]["start_s"] == pytest.approx(3.0)
    assert out["upload"][0]["end_s"] == pytest.approx(3.5)
    assert out["transfer_span_s"] == pytest.approx({"download": 2.0, "upload": 0.5})
    assert out["cpu_use"] == pytest.approx(sum(cpu) / len(cpu))
    # transfer intervals: 0, 1, 2, 3 (downloads), 6 (uploads)
    assert out["cpu_use_transfer"] == pytest.approx((1 + 1 + 2 + 2 + 0.5) / 5)


def test_clients_leaves_the_server_out_of_the_spans() -> None:
    quiet = [(0.0, 0.0)] * 4
    busy = [(1e6, 0.0), (0.0, 0.0), (0.0, 0.0), (1e6, 0.0)]
    rows = _samples([1.0] * 4, [busy, quiet])
    assert round_activity(rows, 1000.0, 1002.0)["transfer_span_s"]["upload"] == pytest.approx(2.0)
    out = round_activity(rows, 1000.0, 1002.0, clients=1)
    assert out["transfer_span_s"]["upload"] == pytest.approx(2.0)
    out = round_activity(_samples([1.0] * 4, [quiet, busy]), 1000.0, 1002.0, clients=1)
    assert out["transfer_span_s"] == {"upload": 0.0, "download": 0.0}
    assert out["cpu_use_transfer"] is None


def test_rounds_activity_cuts_each_recorded_round() -> None:
    rates = [(0.0, 1e6), (0.0, 0.0), (0.0, 0.0), (0.0, 1e6)]
    rows = _samples([1.0] * 4, [rates])
    result = {"rounds": [{"round": 1, "started_at": 1000.0, "wall_s": 1.0},
                         {"round": 2, "started_at": 1001.0, "wall_s": 1.0},
                         {"round": 3, "wall_s": 1.0}]}  # an older file: no start, skipped
    out = rounds_activity(result, rows)
    assert [r["round"] for r in out] == [1, 2]
    assert out[0]["download"][0]["end_s"] == pytest.approx(0.5)
    assert out[1]["download"][0]["start_s"] == pytest.approx(0.5)


def test_bad_windows_are_refused() -> None:
    rows = _samples([1.0] * 4, [[(0.0, 0.0)] * 4])
    with pytest.raises(ValueError, match="not after its start"):
        round_activity(rows, 1002.0, 1001.0)
    with pytest.raises(ValueError, match="sample faster"):
        round_activity(rows, 1000.0, 1000.4)


def test_counters_of_this_namespace() -> None:
    (rx, tx), = _port_bytes(["lo"])
    assert rx >= 0 and tx >= 0
    with pytest.raises(RuntimeError, match="no counters"):
        _port_bytes(["no-such-port0"])
    assert _busy_cpu_s() > 0


def test_a_failing_sampler_keeps_its_error_and_never_raises_into_the_run() -> None:
    sampler = ActivitySampler("fdt-no-such-namespace-hub", ["p0"], 0.05).start()
    assert sampler.stop() == []
    assert isinstance(sampler.error, OSError)
    assert sampler.stop() == []  # idempotent
    with pytest.raises(ValueError, match="interval_s"):
        ActivitySampler("hub", ["p0"], 0.0)
