"""No client-state leak in simulation: 200 rounds, 10 clients on 2 Ray actors.

Flower's actor pool has no client affinity, so each actor serves every client in turn.
A process keeps one live replica per run, shared by the clients it serves
(:mod:`clients.state`): each actor must hold exactly one, whatever the number of clients
(before, one per client; earlier still, entries keyed by a per-save token piled up to 256
replicas per actor). The clients report how many replicas their process keeps
(``FEDDDL_CLIENT_TIMING=1`` diagnostics) and the run records the largest per round.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedddl.app_config import AppConfig
from fedddl.flower.simulation import run

CLIENTS = 10


@pytest.mark.slow
def test_200_rounds_on_2_actors_keep_one_replica_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDDDL_CLIENT_TIMING", "1")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    cfg = AppConfig(num_server_rounds=200, eval_every=50)
    two_actors = (os.cpu_count() or 2) / 2
    result = run(cfg, num_clients=CLIENTS, num_cpus_per_client=two_actors, progress=None)
    rounds = result["rounds"]
    assert len(rounds) == 200 and all(r["replicas_equal"] for r in rounds)
    cached = [r["client_cached_max"] for r in rounds]
    assert max(cached) == 1, max(cached)
