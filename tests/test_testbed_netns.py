"""The testbed network: real namespaces, a rate-limited veth link, counters, clean-up.

Needs root and kernel support (namespaces, veth, htb, u32); skipped with the
reason printed otherwise. The support check's own error messages are tested
everywhere.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fedddl.testbed import netns
from fedddl.testbed.flower_run import TCP_OVERHEAD
from fedddl.testbed.netns import (
    LinkRates,
    Testbed,
    TestbedUnsupported,
    check_support,
    cleanup_recorded,
    run_in_netns,
)

PAYLOAD = 600_000


def _existing() -> set[str]:
    out = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True,
                         check=True).stdout
    return {entry["name"] for entry in json.loads(out or "[]")}


@pytest.fixture
def supported() -> None:
    try:
        check_support()
    except TestbedUnsupported as exc:
        pytest.skip(f"testbed not available here: {exc}")


def test_check_support_names_missing_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedUnsupported, match="needs root"):
        check_support()


def test_check_support_names_missing_iproute2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None)
    with pytest.raises(TestbedUnsupported, match="`ip` command"):
        check_support()


def _best_of(tries: int, net: Testbed, src: int, dst: int, nbytes: int) -> float:
    """Fastest of ``tries`` transfers: a limiter caps the best one, CPU load only slows."""
    return min(_send(net, src, dst, nbytes)[0] for _ in range(tries))


def _send(net: Testbed, src: int, dst: int, nbytes: int) -> tuple[float, int]:
    """Send ``nbytes`` over TCP from ``src`` to ``dst``; return (seconds, bytes received)."""
    server = run_in_netns(net.namespace(dst), lambda: socket.create_server((net.address(dst), 0)))
    port = server.getsockname()[1]
    got: list[tuple[int, float]] = []

    def serve() -> None:
        conn, _ = server.accept()
        total = 0
        while data := conn.recv(1 << 16):
            total += len(data)
        got.append((total, time.monotonic()))
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()

    def send() -> float:
        with socket.create_connection((net.address(dst), port), timeout=30) as sock:
            start = time.monotonic()
            sock.sendall(b"x" * nbytes)
        return start

    start = run_in_netns(net.namespace(src), send)
    thread.join(timeout=60)
    server.close()
    return got[0][1] - start, got[0][0]


@pytest.mark.e2e
def test_link_rate_counters_and_cleanup(supported: None, tmp_path: Path) -> None:
    record = tmp_path / "namespaces.json"
    rates = [LinkRates(uplink_Bps=4e6, per_peer_Bps={1: 5e5}), LinkRates(),
             LinkRates(downlink_Bps=2.5e5)]
    net = Testbed(rates, record=record)
    with net:
        names = net.namespaces
        assert set(names) <= _existing() and len(names) == 4
        assert json.loads(record.read_text())["namespaces"] == names
        # Each node's TCP counters are its own namespace's: fresh ones, nothing resent.
        assert [net.tcp_retransmitted_segments(i) for i in range(3)] == [0, 0, 0]
        # 0 -> 1 is capped by its per-peer class (500 kB/s); 1 -> 0 is not limited.
        before = net.counters(0)
        _, received = _send(net, 0, 1, PAYLOAD)
        after = net.counters(0)
        assert received == PAYLOAD
        wire = after["tx_bytes"] - before["tx_bytes"]
        assert PAYLOAD * (1 + TCP_OVERHEAD) <= wire <= PAYLOAD * (1 + TCP_OVERHEAD) * 1.01
        assert net.peer_bytes(0)[1] >= PAYLOAD
        seconds = _best_of(3, net, 0, 1, PAYLOAD)
        assert 0.85 < PAYLOAD * (1 + TCP_OVERHEAD) / 5e5 / seconds < 1.1, seconds
        fast = _best_of(3, net, 1, 0, PAYLOAD)
        assert fast < seconds / 3
        # 1 -> 2 is capped by node 2's downlink (250 kB/s).
        slow = _best_of(2, net, 1, 2, PAYLOAD // 2)
        assert 0.85 < PAYLOAD / 2 * (1 + TCP_OVERHEAD) / 2.5e5 / slow < 1.1, slow
        # A process left inside a namespace is killed by the teardown.
        sleeper = subprocess.Popen([*net.exec_prefix(2), "sleep", "300"])
    assert not set(names) & _existing()
    assert sleeper.wait(timeout=10) != 0
    assert not record.exists()


@pytest.mark.e2e
def test_failed_build_and_interrupt_tear_everything_down(supported: None, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    net = Testbed([LinkRates(), LinkRates()], record=tmp_path / "rec.json")
    with pytest.raises(KeyboardInterrupt), net:
        names = net.namespaces
        raise KeyboardInterrupt
    assert not set(names) & _existing()

    calls = {"n": 0}
    real_run = netns._run

    def failing(argv: list[str], what: str) -> str:
        calls["n"] += 1
        if "gso_max_size" in argv and calls["n"] > 8:
            raise netns.TestbedError("injected failure")
        return real_run(argv, what)

    monkeypatch.setattr(netns, "_run", failing)
    broken = Testbed([LinkRates(), LinkRates()])
    with pytest.raises(netns.TestbedError, match="injected"):
        broken.up()
    assert broken.namespaces == []
    assert not {n for n in _existing() if n.startswith(f"fdt{broken.run_id}")}


@pytest.mark.e2e
def test_cleanup_recorded_deletes_only_listed_namespaces(supported: None, tmp_path: Path) -> None:
    net = Testbed([LinkRates()], record=tmp_path / "rec.json")
    net.up()
    names = net.namespaces
    (tmp_path / "copy.json").write_text((tmp_path / "rec.json").read_text())
    # Simulate a killed run: the record stays, the namespaces stay.
    removed = cleanup_recorded(tmp_path / "copy.json")
    assert sorted(removed) == sorted(names)
    assert not set(names) & _existing()
    net.down()  # nothing left to delete: no error


@pytest.mark.e2e
def test_real_gossip_peers_train_over_mutual_tls_on_the_testbed(supported: None,
                                                                tmp_path: Path) -> None:
    """Two real peers in their own namespaces: they must talk TLS (non-loopback addresses)."""
    from fedddl.network import NetworkModel
    from fedddl.testbed.gossip_run import run_gossip_testbed

    before = _existing()
    result = run_gossip_testbed(
        NetworkModel.homogeneous(2, latency_s=0.001), tmp_path / "run", scheduler="random",
        overlap=True, target=0.0,
        # steps of at least 50 ms: on a loaded machine 20 free-running steps can end before
        # the first exchange completes (seen with another experiment on both cores)
        peer_options={"steps": 20, "min-step-s": 0.05, "dataset": "digits", "eval-every": 10},
        timeout_s=180.0,
    )
    assert result["steps_per_node"] == [20, 20]
    assert result["messages"] > 0 and result["bytes_total"] > 0 and result["send_failures"] == 0
    assert result["time_to_target_s"] is not None and 0.0 <= result["final_accuracy"] <= 1.0
    assert (tmp_path / "run" / "tls" / "gossip" / "node-1.pem").is_file()
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("peer-*.log"))
    assert "--insecure" not in logs and "error" not in logs.lower()
    assert _existing() == before  # namespaces torn down
