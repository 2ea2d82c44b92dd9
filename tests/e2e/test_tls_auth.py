"""Loopback deployment with TLS and SuperNode authentication (Flower 1.42).

The SuperLink serves TLS with certificates made by :mod:`fedddl.deploy.certs`
and runs ``--enable-supernode-auth``: only SuperNodes whose public key was
registered with ``flwr supernode register`` are admitted. A registered
SuperNode joins and runs a FedAvg round over TLS; a SuperNode with an
unregistered key is refused and never becomes a node of the federation, and
one that trusts a different CA cannot even connect.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from fedddl.deploy.certs import write_supernode_keys, write_tls_material
from fedddl.deploy.processes import (
    ManagedProcess,
    ProcessRegistry,
    register_supernode,
    run_flwr,
    start_superlink,
    start_supernode,
    write_flwr_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# SuperNodes that are meant to be refused: plain flower-supernode, no warm
# ClientApp server (it would only cost CPU).
_NEVER_RUNS_APPS: dict[str, Any] = {"poll_interval_s": None, "warm_clientapp_preload": None}


def test_tls_deployment_admits_registered_supernode_and_refuses_unknown_key(
    tmp_path: Path,
    flwr_home: Path,
    flwr_env: dict[str, str],
    processes: ProcessRegistry,
    latency_app_dir: Path,
) -> None:
    tls = write_tls_material(tmp_path / "certs")
    good, rogue = write_supernode_keys(tmp_path / "keys", ["good", "rogue"])
    logs = tmp_path / "logs"

    superlink = processes.add(
        start_superlink(logs, env=flwr_env, tls=tls, enable_supernode_auth=True)
    )
    write_flwr_config(flwr_home, {"e2e": superlink.address}, root_certificate=tls.ca_certificate)
    registered_id = register_supernode(good.public_key, "e2e", env=flwr_env)

    # The refused ones first, so they have had the whole test to (fail to) get in.
    # A SuperNode that trusts another CA must not talk to this SuperLink at all,
    # even holding a registered key.
    other_ca = write_tls_material(tmp_path / "other-ca")
    untrusting = processes.add(
        start_supernode(
            "untrusting", superlink.address, logs, env=flwr_env,
            root_certificate=other_ca.ca_certificate, auth_private_key=good.private_key,
            extra_args=["--max-retries", "1", "--max-wait-time", "5"], wait_ready=False,
            **_NEVER_RUNS_APPS,
        )
    )
    intruder = processes.add(
        start_supernode(
            "rogue", superlink.address, logs, env=flwr_env,
            root_certificate=tls.ca_certificate, auth_private_key=rogue.private_key,
            wait_ready=False, **_NEVER_RUNS_APPS,
        )
    )
    member = processes.add(
        start_supernode(
            "good", superlink.address, logs, env=flwr_env,
            root_certificate=tls.ca_certificate, auth_private_key=good.private_key,
            node_config={"partition-id": 0, "num-partitions": 1},
        )
    )
    assert member.node_id == registered_id

    results = tmp_path / "results.json"
    run = run_flwr(
        ["run", str(latency_app_dir), "e2e", "--stream", "--run-config",
         f'num-server-rounds=1 min-nodes=1 federated-evaluate=0 grid-poll-interval=0.05 '
         f'results-path="{results}"'],
        env=flwr_env, timeout_s=240,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    outcome = json.loads(results.read_text())
    assert len(outcome["round_seconds"]) == 1
    assert "Received 1 results and 0 failures" in run.stdout, run.stdout[-4000:]

    # The SuperLink lists exactly the registered node; the intruder never got an id.
    listing = run_flwr(["supernode", "list", "e2e", "--format", "json"], env=flwr_env)
    assert listing.returncode == 0, listing.stdout
    listed_ids = {int(i) for i in re.findall(r'"node-id":\s*"?(\d+)', listing.stdout)}
    assert listed_ids == {registered_id}, listing.stdout
    # The intruder's activation is rejected: the SuperNode exits with Flower's
    # "Failed to activate SuperNode" and the SuperLink logs the unknown key.
    _wait_until_exited(intruder, timeout_s=30)
    intruder_log = intruder.log_text()
    assert "SuperNode ID:" not in intruder_log, intruder_log[-3000:]
    assert "Failed to activate SuperNode" in intruder_log, intruder_log[-3000:]
    assert "No SuperNode found with the given public key" in superlink.log_text()

    _wait_until_exited(untrusting, timeout_s=30)
    untrusting_log = untrusting.log_text()
    assert "SuperNode ID:" not in untrusting_log, untrusting_log[-3000:]
    assert re.search(r"(?i)certificate|ssl|tls", untrusting_log), untrusting_log[-3000:]


def _wait_until_exited(process: ManagedProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while process.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process.alive(), f"{process.name} still running:\n{process.log_text()[-3000:]}"
