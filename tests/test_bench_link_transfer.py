"""simulations.bench_link_transfer on a real shaped link (root; skipped where unsupported)."""

from __future__ import annotations

import pytest

from fedddl.testbed.netns import TestbedUnsupported, check_support
from fedddl.testbed.predict import WIRE_FACTOR
from simulations.bench_link_transfer import HEADER, _row, bench


@pytest.fixture
def supported() -> None:
    try:
        check_support()
    except TestbedUnsupported as exc:
        pytest.skip(f"testbed not available here: {exc}")


@pytest.mark.usefixtures("supported")
def test_transfers_over_a_10_mbit_link_take_bytes_over_rate_times_framing() -> None:
    """Raw TCP and Flower-like gRPC pushes of 0.3 MB over a 10 Mbit/s htb link take
    bytes / rate x the TCP/IP framing (1.046), measured 1.03-1.07; nothing is dropped."""
    cells = bench([10.0], [0.3], ["tcp", "grpc-objects"], repeats=2, idle_s=0.0, objects=4,
                  big_mb=None)
    assert [c["mode"] for c in cells] == ["tcp", "grpc-objects"]
    for cell in cells:
        assert cell["predicted_s"] == pytest.approx(0.24)
        assert len(cell["times_s"]) == 2
        assert 0.95 * WIRE_FACTOR <= cell["ratio_median"] <= 1.3 * WIRE_FACTOR, cell
        assert cell["qdisc"]["drops"] == 0
        assert _row(cell).count("|") == HEADER.splitlines()[0].count("|")
