"""Real gossip peers: 4 node processes on loopback train ``digits`` over gRPC.

Checks that accuracy rises, that every node merges models from the others,
that a node that hangs and then dies does not stop the rest (send timeouts, no
deadlock), and that SIGTERM stops a node gracefully with its metrics written.
Every process is started in its own session and its whole group is killed at
the end, also when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedddl.gossip.peer_files import METRICS_FILE, NODE_FILE, read_json, wait_for_json, write_peers
from fedddl.models import create_model
from tests.support.gossip_nodes import model_frame, raw_send

pytestmark = pytest.mark.e2e

STEPS = 300


class PeerProcesses:
    """Starts ``python -m fedddl.gossip.peer`` processes and always kills them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def state_dir(self, node: int) -> Path:
        return self.root / f"node-{node}"

    def start(self, node: int, num_nodes: int, *extra: str) -> None:
        state = self.state_dir(node)
        state.mkdir(parents=True)
        log = (state / "peer.log").open("wb")
        self.procs[node] = subprocess.Popen(
            [sys.executable, "-m", "fedddl.gossip.peer", "--node-id", str(node),
             "--num-nodes", str(num_nodes), "--bind", "127.0.0.1:0", "--state-dir", str(state),
             "--max-lifetime-s", "170", "--log-level", "INFO", "--insecure", *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

    def address(self, node: int, timeout_s: float = 90) -> str:
        info = wait_for_json(self.state_dir(node) / NODE_FILE, timeout_s)
        assert info["pid"] == self.procs[node].pid
        return str(info["address"])

    def metrics(self, node: int) -> dict[str, Any]:
        content = read_json(self.state_dir(node) / METRICS_FILE)
        return content if isinstance(content, dict) else {}

    def log(self, node: int, *, whole: bool = False) -> str:
        text = (self.state_dir(node) / "peer.log").read_text(errors="replace")
        return text if whole else text[-3000:]

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture()
def peers(tmp_path: Path) -> Iterator[PeerProcesses]:
    group = PeerProcesses(tmp_path)
    yield group
    group.kill_all()


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def test_four_peers_learn_together_and_survive_dead_nodes(peers: PeerProcesses) -> None:
    n = 4
    began = time.monotonic()
    for node in range(n):
        peers.start(node, n, "--steps", str(STEPS), "--min-step-s", "0.01",
                    "--send-timeout-s", "0.5", "--shaper", "*=0.002", "--eval-every", "50")
    addresses = {node: peers.address(node) for node in range(n)}
    assert len(set(addresses.values())) == n
    for node in range(n):
        write_peers(peers.state_dir(node), addresses)
    started = time.monotonic()

    # Let everybody gossip a while, then hang node 3 (peers hit send timeouts) and
    # kill it hard; stop node 2 gracefully with SIGTERM.
    _wait(lambda: all(peers.metrics(i).get("steps", 0) >= 40 for i in range(n)), 90,
          "all nodes to reach step 40")
    # An outsider (plaintext here, so no certificate identity) claims to be a stranger,
    # then node 1 with absurd weights: refused every time, counted per peer and reason
    # in node 0's metrics file, logged once per (peer, reason).
    absurd = {k: v + 1e6 for k, v in create_model("digits", seed=1).state_dict().items()}
    for _ in range(3):
        stranger = raw_send(addresses[0], model_frame(absurd, 7))
        assert stranger[0] == grpc.StatusCode.PERMISSION_DENIED, stranger
        spoofed = raw_send(addresses[0], model_frame(absurd, 1))
        assert spoofed[0] == grpc.StatusCode.INVALID_ARGUMENT, spoofed
    hung, stopped = peers.procs[3], peers.procs[2]
    os.kill(hung.pid, signal.SIGSTOP)
    time.sleep(1.5)
    os.killpg(hung.pid, signal.SIGKILL)
    stopped.send_signal(signal.SIGTERM)
    assert hung.wait(timeout=10) == -signal.SIGKILL
    assert stopped.wait(timeout=20) == 0

    for node in range(n - 2):
        try:
            assert peers.procs[node].wait(timeout=120) == 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {node} did not finish: {peers.metrics(node)}\n{peers.log(node)}")
    print(f"startup {started - began:.1f} s, training {time.monotonic() - started:.1f} s")

    # The killed node left only a periodic snapshot; the SIGTERMed one a full exit record.
    killed, terminated = peers.metrics(3), peers.metrics(2)
    assert "exited" not in killed and 40 <= killed["steps"] < STEPS
    assert terminated["exited"] and terminated["exit_reason"] == "SIGTERM"
    assert 40 <= terminated["steps"] < STEPS and not terminated["finished"]

    survivors = [peers.metrics(node) for node in range(n - 2)]
    for node, m in enumerate(survivors):
        summary = json.dumps({k: m[k] for k in ("steps", "received_from", "sent_to",
                                                "send_failures", "initial_accuracy",
                                                "final_accuracy")})
        print(f"node {node}: {summary}")
        assert m["exited"] and m["exit_reason"] == "finished", summary
        assert m["finished"] and m["steps"] == STEPS, summary
        assert m["initial_accuracy"] < 0.3 and m["final_accuracy"] > 0.8, summary
        assert m["final_accuracy"] > m["initial_accuracy"] + 0.5, summary
        others = {int(k) for k, v in m["received_from"].items() if v > 0}
        assert len(others) >= 2 and node not in others, summary
        assert m["merged"] > 0 and m["bytes_received"] > 0 and m["bytes_sent"] > 0, summary
        assert [a["step"] for a in m["accuracy"]][:2] == [0, 50], summary
    rejections = survivors[0]["rejections"]
    assert rejections["node 7"] == {"unknown-sender": 3}, rejections
    assert rejections["node 1"].get("weight-range") == 3, rejections
    lines = [line for line in peers.log(0, whole=True).splitlines() if "rejected frame" in line]
    assert sum("from node 7" in line for line in lines) == 1, lines
    assert sum("from node 1" in line and "'weight-range'" in line for line in lines) == 1, lines
    # Somebody tried the hung or dead node, timed out or was refused, and moved on.
    assert sum(m["send_failures"] for m in survivors) >= 1
