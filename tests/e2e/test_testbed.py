"""The WAN testbed: a real TLS Flower deployment over rate-limited namespace links.

A SuperLink and 2 SuperNodes, each in its own network namespace, run one
GradientAverage round (digits, the small CNN: ~90 kB per message) twice on one
deployment: first with unlimited links, then with every SuperNode's access link
shaped so that the ``fedddl.network`` model predicts ~15 s more (the rate is
computed from the first run's byte counts and the app bundle's size, ~0.8 Mbit/s;
most of the 15 s is the app bundle every SuperNode downloads at the start of a
run). Checks:

* the bytes counted on the SuperNodes' interfaces lie in the band the testbed
  documents around the application's own counts (``wire_bounds``: payload plus
  TCP/IP framing and ACKs, at most plus the idle poll traffic and the segments
  TCP retransmitted), both directions, both runs; the upper bounds are not
  checked (and that is printed) when a process logged a retried connection,
  whose resent bytes the application does not count; a run above the upper
  bound is printed and run once more, and the second run is checked;
* the limited run takes longer than the unlimited one by about the predicted
  amount: within [0.6, 1.7] x, a band wide enough for a shared, loaded 2-core
  machine, where a ClientApp's compute time per message varies by several seconds;
* the link activity sampled beside the limited run (``<run>.activity.json``) saw every
  client upload at least the round's application bytes;
* no namespace of the run is left behind.

Skipped, with the reason printed (``pytest -ra``), where namespaces, veth pairs,
htb or root are not available.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedddl.testbed.netns import LinkRates, TestbedUnsupported, check_support

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIG = {"strategy": "gradient-average", "dataset": "digits", "arch": "cnn",
              "num-server-rounds": 1}
PREDICTED_EXTRA_S = 15.0


def _existing_namespaces() -> set[str]:
    import json
    import subprocess

    out = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True,
                         check=True).stdout
    return {entry["name"] for entry in json.loads(out or "[]")}


def _log_lines(work: Path, *needles: str) -> list[str]:
    """The processes' log lines containing any of ``needles`` (the last 20)."""
    lines = [f"{log.name}: {line.strip()}" for log in sorted(work.rglob("*.log"))
             for line in log.read_text(errors="replace").splitlines()
             if any(needle in line for needle in needles)]
    return lines[-20:]


def _above_band(run: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The directions whose wire bytes exceed ``wire_bounds``' upper bound."""
    from fedddl.testbed.flower_run import wire_bounds

    section = run["testbed"]
    return [(key, section["wire"][key], high)
            for key, (_, high) in wire_bounds(section).items() if section["wire"][key] > high]


def _run_within_band(bed: Any, name: str) -> dict[str, Any]:
    """One run; run again, once, if its wire bytes exceeded the band's upper bound.

    A one-off excess (a burst of resent data on a loaded machine, once 17.5 % in CI) is
    printed, not failed on; the second run is checked like the first.
    """
    run: dict[str, Any] = bed.run(RUN_CONFIG, name)
    above = _above_band(run)
    if above:
        print(f"{name}: wire bytes above the band {above}, resent segments "
              f"{run['testbed']['retransmitted_segments']}; running it again")
        run = bed.run(RUN_CONFIG, f"{name}-again")
    return run


def test_rate_limited_deployment_matches_wire_counts_and_predicted_slowdown(
    tmp_path: Path, flwr_env: dict[str, str]
) -> None:
    try:
        check_support()
    except TestbedUnsupported as exc:
        pytest.skip(f"testbed not available here: {exc}")
    from fedddl.testbed.flower_run import FlowerTestbed, wire_bounds
    from fedddl.testbed.predict import predict_flower

    bed = FlowerTestbed([LinkRates(), LinkRates()], tmp_path / "bed", REPO_ROOT)
    created: list[str] = []
    with bed:
        created = bed.net.namespaces
        free = _run_within_band(bed, "unlimited")
        fab = free["testbed"]["app_bytes"]["fab_per_supernode"]
        # Transfer time at 1 MB/s scales as 1 / rate: pick the rate giving ~15 s.
        probe = predict_flower(free, free, [LinkRates(1e6, 1e6)] * 2, fab_bytes=fab)
        rate = 1e6 * probe["transfer_s"] / PREDICTED_EXTRA_S
        limits = [LinkRates(uplink_Bps=rate, downlink_Bps=rate)] * 2
        bed.set_client_rates(limits)
        slow = _run_within_band(bed, "limited")

    assert not set(created) & _existing_namespaces(), "namespaces left behind"
    # A request Flower retried (a lost connection) sends its bytes again, uncounted by
    # the application: the upper bounds hold only for runs without one.
    retried = _log_lines(tmp_path / "bed", "Connection attempt failed", "tries.")
    problems = _log_lines(tmp_path / "bed", "ERROR", "WARNING")
    for run in (free, slow):
        section = run["testbed"]
        assert len(run["rounds"]) == 1
        assert section["app_bytes"]["up"] > 2 * 80_000  # fp32 CNN gradients went up
        for key, (low, high) in wire_bounds(section).items():
            measured = section["wire"][key]
            details = (section["name"], key, low, measured, high,
                       section["retransmitted_segments"], section["run_s"], problems)
            assert low <= measured, details
            if retried:
                print("upper bound not checked, Flower retried a connection:", details, retried)
            else:
                assert measured <= high, details

    # The link activity sampled beside the run saw the round's uploads on the clients' ports.
    from fedddl.testbed.activity import rounds_activity

    activity = tmp_path / "bed" / "results" / f"{slow['testbed']['name']}.activity.json"
    (round1,) = rounds_activity(slow, json.loads(activity.read_text())["samples"], clients=2)
    assert sum(s["bytes"] for s in round1["upload"]) >= 0.95 * slow["rounds"][0]["bytes_up"]
    assert all(s["busy_s"] > 0 for s in round1["upload"])

    predicted = predict_flower(slow, free, limits, fab_bytes=fab)
    measured_extra = sum(r["wall_s"] for r in slow["rounds"]) - sum(
        r["wall_s"] for r in free["rounds"])
    print(f"rate {rate * 8 / 1e6:.2f} Mbit/s: measured extra {measured_extra:.1f} s, "
          f"predicted {predicted['transfer_s']:.1f} s")
    assert 0.6 * predicted["transfer_s"] <= measured_extra <= 1.7 * predicted["transfer_s"]
