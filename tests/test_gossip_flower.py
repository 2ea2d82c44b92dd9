"""Gossip mode in Flower: coordinator ServerApp and client handler under ``run_simulation``.

The peers exchange models among themselves; the coordinator only sees small
status messages, which the test measures.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from clients.gossip_client import handle_gossip
from fedddl.gossip.peer_files import pid_alive, read_json
from fedddl.gossip.peer_launcher import peer_cli_args
from fedddl.gossip.peer_protocol import ACTION, REPLY_RECORD, REQUEST_RECORD
from fedddl.models import create_model
from strategies.gossip_coordinator import GossipConfig, GossipResult, run_gossip

NUM_NODES = 3
STEPS = 150


def _kill_spawned_peers(root: Path) -> None:
    for name in ("node.json", "spawned.json"):
        for path in root.glob(f"**/{name}"):
            content = read_json(path)
            if isinstance(content, dict) and pid_alive(int(content["pid"])):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(int(content["pid"]), signal.SIGKILL)


@pytest.fixture()
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("FLWR_DISABLE_UPDATE_CHECK", "1")
    monkeypatch.setenv("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    root = tmp_path / "gossip-run"
    yield root
    _kill_spawned_peers(root)  # whatever happened, no peer outlives the test


def _apps(config: GossipConfig, results: list[GossipResult]) -> tuple[ServerApp, ClientApp]:
    client_app = ClientApp()
    client_app.query(ACTION)(handle_gossip)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        results.append(run_gossip(grid, context, config))

    return server_app, client_app


@pytest.mark.slow
def test_gossip_nodes_train_peer_to_peer_under_flower(run_dir: Path) -> None:
    config = GossipConfig(
        num_nodes=NUM_NODES,
        peer_options={"insecure": True, "steps": STEPS, "min-step-s": 0.01, "scheduler": "random",
                      "eval-every": 50, "send-timeout-s": 1.0, "max-lifetime-s": 300.0,
                      "peers-timeout-s": 240.0},
        run_dir=str(run_dir),
        startup_timeout_s=240,  # 3 torch imports on 2 busy cores can take a minute
        run_timeout_s=150,
        poll_interval_s=0.5,
        results_path=str(run_dir / "result.json"),
    )
    results: list[GossipResult] = []
    server_app, client_app = _apps(config, results)
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=NUM_NODES,
        # One actor: handlers return at once, and every actor process costs a torch import.
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}},
    )
    assert len(results) == 1, "the ServerApp did not complete (see the log above)"
    result = results[0]
    print(f"phases {result.phase_s}, messages {result.messages}, "
          f"max {result.max_message_bytes} B, total {result.total_message_bytes} B")

    assert sorted(result.metrics) == list(range(NUM_NODES))
    assert len(set(result.addresses.values())) == NUM_NODES
    assert all(a.startswith("127.0.0.1:") for a in result.addresses.values())
    for gossip_id, m in result.metrics.items():
        assert m["finished"] == 1 and m["exited"] == 1 and m["steps"] == STEPS, m
        assert m["exit-reason"] == "finished", m
        senders = {int(k) for k, v in m["received-from"].items() if v > 0}
        assert m["received"] > 0 and senders and gossip_id not in senders, m
        assert m["final_accuracy"] > m["initial_accuracy"] + 0.3, m

    # The model went peer to peer; the coordinator only saw small messages.
    model_bytes = sum(t.numel() * t.element_size()
                      for t in create_model("digits", seed=0).state_dict().values())
    peer_bytes = sum(m["bytes_sent"] for m in result.metrics.values())
    assert result.array_records_seen == 0
    assert result.max_message_bytes < 2048 < model_bytes
    assert peer_bytes > 20 * result.total_message_bytes
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["max_message_bytes"] == result.max_message_bytes
    for node in range(NUM_NODES):  # one peer per node, spawned once despite repeated starts
        info = json.loads((run_dir / f"node-{node}" / "node.json").read_text())
        spawned = json.loads((run_dir / f"node-{node}" / "spawned.json").read_text())
        assert info["pid"] == spawned["pid"] and not pid_alive(int(info["pid"]))


def _request(op: str, **fields: Any) -> Message:
    content = RecordDict({REQUEST_RECORD: ConfigRecord({"op": op, **fields})})
    return Message(content=content, dst_node_id=1, message_type="query.gossip")


@pytest.fixture()
def task_identity() -> None:
    """Flower's Message constructor reads the process' task identity (set by a runtime)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_task_id", "_node_id"):
        if getattr(TaskIdentity, attr) is None:
            setattr(TaskIdentity, attr, 1)


@pytest.mark.usefixtures("task_identity")
def test_handler_reports_bad_requests_without_spawning(tmp_path: Path) -> None:
    context = Context(run_id=1, node_id=1, node_config={"gossip-state-dir": str(tmp_path / "s")},
                      state=RecordDict(), run_config={})
    cases = {
        "unknown gossip op": _request("dance", **{"gossip-id": 0}),
        "'gossip-id' must be": _request("status"),
        "unknown peer option": _request("start", **{"gossip-id": 0, "num-nodes": 2,
                                                    "peer-options": '{"exec": "rm"}'}),
        "bad peer entry": _request("peers", **{"gossip-id": 0, "peers": "0=nowhere"}),
    }
    for reason, msg in cases.items():
        reply = handle_gossip(msg, context).content.config_records[REPLY_RECORD]
        assert reply["status"] == "error" and reason in str(reply["error"]), reply
    assert not (tmp_path / "s" / "spawned.json").exists()
    # hello: the pinned gossip id of the node config, -1 without one; a bad pin is an error.
    assert handle_gossip(_request("hello"), context).content.config_records[REPLY_RECORD][
        "pinned-id"] == -1
    context.node_config["gossip-id"] = 2
    assert handle_gossip(_request("hello"), context).content.config_records[REPLY_RECORD][
        "pinned-id"] == 2
    context.node_config["gossip-id"] = "two"
    reply = handle_gossip(_request("hello"), context).content.config_records[REPLY_RECORD]
    assert reply["status"] == "error" and "gossip-id must be" in str(reply["error"])


def test_peer_options_are_type_checked() -> None:
    args = peer_cli_args(1, 3, "127.0.0.1:0", "", {"steps": 5, "learning-rate": 1})
    assert args[-4:] == ["--learning-rate", "1", "--steps", "5"]
    # Flags appear when true; empty strings mean "not set" (run-config defaults).
    args = peer_cli_args(1, 3, "127.0.0.1:0", "", {"insecure": True, "tls-dir": "",
                                                   "compressor": "ternary-base3"})
    assert args[-3:] == ["--compressor", "ternary-base3", "--insecure"] and "--tls-dir" not in args
    assert "--insecure" not in peer_cli_args(1, 3, "127.0.0.1:0", "", {"insecure": False})
    with pytest.raises(ValueError, match="must be bool"):
        peer_cli_args(1, 3, "127.0.0.1:0", "", {"insecure": "yes"})
    with pytest.raises(ValueError, match="must be int"):
        peer_cli_args(1, 3, "127.0.0.1:0", "", {"steps": "5; rm -rf"})
    with pytest.raises(ValueError, match="unknown peer options"):
        GossipConfig(num_nodes=2, peer_options={"bind": "0.0.0.0:1"})
