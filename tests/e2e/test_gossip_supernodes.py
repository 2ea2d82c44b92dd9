"""Gossip mode through ``flwr run`` on a real SuperLink and 3 real SuperNodes (loopback).

The ServerApp coordinates (``strategy = "gossip"``); every SuperNode's ClientApp
spawns its node's gossip peer, and the peers exchange compressed model
differences directly, with mutual TLS from ``fedddl deploy certs
--gossip-peers 3``. Once every peer trains, one SuperNode is stopped and its
peer killed (the machine is gone). The coordinator gives that node up, the two
others finish their steps, and the run completes. From the results JSON the
ServerApp writes, the test checks who finished, that they trained each other,
that every peer ran TLS with compression and that no frame was refused for a
wrong identity.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from fedddl.deploy.certs import write_tls_material
from fedddl.deploy.processes import (
    ManagedProcess,
    ProcessRegistry,
    start_process,
    start_superlink,
    start_supernode,
    write_flwr_config,
)
from fedddl.gossip.peer_files import read_json
from fedddl.proc import pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
NODES = 3
STEPS = 400  # 20 s at gossip-min-step-s=0.05: the victim dies mid-training
PRELOAD = ["torch", "numpy"]


def _peer_pids(run_dir: Path) -> dict[int, int]:
    pids = {}
    for node in range(NODES):
        info = read_json(run_dir / f"node-{node}" / "node.json")
        if isinstance(info, dict):
            pids[node] = int(info["pid"])
    return pids


def _steps(run_dir: Path, node: int) -> int:
    metrics = read_json(run_dir / f"node-{node}" / "metrics.json")
    return int(metrics.get("steps", 0)) if isinstance(metrics, dict) else 0


def test_gossip_across_supernodes_with_mutual_tls_survives_a_lost_node(
    tmp_path: Path, flwr_home: Path, flwr_env: dict[str, str], processes: ProcessRegistry
) -> None:
    if not (REPO_ROOT / "strategies" / "server_app.py").exists():
        pytest.skip("the fedddl Flower app is not present")
    tls = write_tls_material(tmp_path / "certs", gossip_peers=NODES)
    assert tls.gossip_dir is not None
    logs, run_dir, results = tmp_path / "logs", tmp_path / "gossip-run", tmp_path / "result.json"
    superlink = processes.add(start_superlink(logs, env=flwr_env))
    nodes: list[ManagedProcess] = [
        processes.add(start_supernode(f"supernode-{i}", superlink.address, logs, env=flwr_env,
                                      warm_clientapp_preload=PRELOAD))
        for i in range(NODES)
    ]
    write_flwr_config(flwr_home, {"e2e": superlink.address})
    run_config = (
        f'strategy="gossip" gossip-nodes={NODES} gossip-steps={STEPS} '
        f'gossip-tls-dir="{tls.gossip_dir}" gossip-compressor="ternary-base3" '
        f'gossip-min-step-s=0.05 gossip-send-timeout-s=1.0 gossip-eval-every=100 '
        f'gossip-run-dir="{run_dir}" gossip-run-timeout-s=300.0 results-path="{results}"'
    )
    run = processes.add(start_process(
        "flwr-run", ["flwr", "run", str(REPO_ROOT), "e2e", "--stream", "--run-config", run_config],
        logs, env=flwr_env,
    ))
    peer_pids: dict[int, int] = {}
    try:
        # Gossip ids follow the sorted Flower node ids.
        ids = sorted(n.node_id for n in nodes if n.node_id is not None)
        victim = nodes[2]
        lost = ids.index(victim.node_id)
        deadline = time.monotonic() + 300
        # Mid-run: the coordinator polls status (a node that vanishes while its reply to
        # an earlier op is in flight fails the run), and every peer trains.
        while "gossip training:" not in run.log_text() or not all(
            _steps(run_dir, g) >= 30 for g in range(NODES)
        ):
            assert run.alive(), f"flwr run ended early:\n{run.log_text()[-4000:]}"
            assert time.monotonic() < deadline, run.log_text()[-4000:]
            time.sleep(0.2)
        peer_pids = _peer_pids(run_dir)
        assert _steps(run_dir, lost) < STEPS and pid_alive(peer_pids[lost])
        victim.stop()  # the SuperNode deactivates; its peer process would outlive it...
        os.killpg(peer_pids[lost], signal.SIGKILL)  # ... unless the machine goes, as here
        killed_at = _steps(run_dir, lost)

        deadline = time.monotonic() + 300
        while run.alive():
            assert time.monotonic() < deadline, run.log_text()[-4000:]
            time.sleep(0.5)
        assert run.popen.returncode == 0, run.log_text()[-4000:]
    finally:
        for pid in _peer_pids(run_dir).values():  # no peer outlives the test
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)

    outcome = json.loads(results.read_text())
    print(f"node {lost} lost at step {killed_at}: {outcome['lost']}; phases {outcome['phase_s']}")
    assert list(outcome["lost"]) == [str(lost)], outcome["lost"]
    survivors = sorted(set(range(NODES)) - {lost})
    assert sorted(int(g) for g in outcome["metrics"]) == survivors
    for gossip_id in survivors:
        m = outcome["metrics"][str(gossip_id)]
        summary = json.dumps({k: m.get(k) for k in (
            "steps", "received-from", "rejections", "exit-reason", "secure", "compressor",
            "model_bytes_sent", "sent", "initial_accuracy", "final_accuracy")})
        print(f"node {gossip_id}: {summary}")
        assert m["finished"] == 1 and m["steps"] == STEPS, summary
        assert m["exit-reason"] == "finished", summary
        assert m["secure"] == 1 and m["compressor"] == "ternary-base3", summary
        senders = {int(k) for k, v in m["received-from"].items() if v > 0}
        assert senders and gossip_id not in senders, summary
        assert m["final_accuracy"] > m["initial_accuracy"] + 0.3, summary
        refusals = {reason for reasons in m["rejections"].values() for reason in reasons}
        assert not refusals & {"identity-mismatch", "no-identity", "unknown-sender"}, summary
    # Models went peer to peer; the coordinator only saw small messages.
    assert outcome["array_records_seen"] == 0 and outcome["max_message_bytes"] < 4096
