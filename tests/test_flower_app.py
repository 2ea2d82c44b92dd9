"""The README's main job through ``flwr run`` (SuperLink + simulation runtime), small.

It starts detached Flower processes and takes about a minute on two cores. The
detached ``flower-superlink`` / ``flower-superexec`` processes of this test are found
by their ``FLWR_HOME`` and stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
]


def _pids_with_env(key: str, value: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{key}={value}".encode() in env:
            found.append(int(entry.name))
    return found


def test_flwr_run_main_job_writes_results(tmp_path: Path) -> None:
    home = tmp_path / "flwr_home"
    home.mkdir()
    out = tmp_path / "run.json"
    env = dict(
        os.environ,
        FLWR_HOME=str(home),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
    )
    flwr = Path(sys.executable).with_name("flwr")
    cmd = [
        str(flwr), "run", ".", "local",
        "--federation-config", "num-supernodes=3",
        "--run-config", f"num-server-rounds=3 results-path='{out}'",
        "--stream",
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420, check=False
        )
    finally:
        for pid in _pids_with_env("FLWR_HOME", str(home)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "replicas-equal=yes" in log and "fedddl summary" in log
    result = json.loads(out.read_text())
    assert [r["round"] for r in result["rounds"]] == [1, 2, 3]
    assert all(r["replicas_equal"] for r in result["rounds"])
    assert result["config"]["num-clients"] == 3
