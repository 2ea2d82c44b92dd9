"""The README's main job, ``fedddl run`` (``flwr run . local --stream`` on a private
local SuperLink), small: it writes results and leaves no process running.

It starts real Flower processes and takes about a minute on two cores. Every process
it starts carries ``FEDDDL_RUN_TOKEN`` and this test's ``FLWR_HOME`` in its environment;
the test checks that none is alive afterwards (and stops any by pid if one were).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedddl.proc import pids_with_env, stop_pids

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
]


def test_main_job_writes_results_and_leaves_nothing_running(tmp_path: Path) -> None:
    home = tmp_path / "flwr_home"
    home.mkdir()
    out = tmp_path / "run.json"
    env = dict(
        os.environ,
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
    )
    env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", None)  # fedddl run sets it
    cmd = [
        sys.executable, "-m", "fedddl", "run",
        "--federation-config", "num-supernodes=3",
        "--run-config", f"num-server-rounds=3 results-path='{out}'",
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420, check=False
        )
    finally:
        left = pids_with_env("FLWR_HOME", str(home))
        stop_pids(left)  # only if the command under test failed to
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert left == [], f"processes of the run still alive: {left}"
    assert "replicas-equal=yes" in log and "fedddl summary" in log
    assert "nothing of this run is left running" in log
    assert not (home / "local-superlink").exists()  # flwr started no SuperLink of its own
    result = json.loads(out.read_text())
    assert [r["round"] for r in result["rounds"]] == [1, 2, 3]
    assert all(r["replicas_equal"] for r in result["rounds"])
    assert result["config"]["num-clients"] == 3
