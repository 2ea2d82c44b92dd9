"""``docs/examples/quickstart-compressed``: Flower's PyTorch quickstart plus the drop-in.

The app runs through ``flwr run`` (``fedddl run --app``: ``flwr run APP local --stream``
on a private local SuperLink) in a fresh ``FLWR_HOME`` for 2 rounds on 4 simulated
SuperNodes, all training each round; it must finish, send replies at least 12x smaller
than whole models, messages at least 8x smaller after the first training exchange, and
leave no process running. The fast tests check the app's parts in-process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from fedddl.proc import pids_with_env, stop_pids

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "docs" / "examples" / "quickstart-compressed"


def _fashion_mnist_present() -> bool:
    from fedddl.data import DatasetNotFoundError, load_dataset

    try:
        load_dataset("fashion-mnist", split="test")
    except DatasetNotFoundError:
        return False
    return True


needs_data = pytest.mark.skipif(
    not _fashion_mnist_present(), reason="Fashion-MNIST is not installed (no download)"
)


def test_the_pyproject_is_a_flower_app_that_installs_nothing_at_run_time() -> None:
    project = tomllib.loads((APP / "pyproject.toml").read_text())
    assert project["project"]["dependencies"] == []
    components = project["tool"]["flwr"]["app"]["components"]
    assert components == {
        "serverapp": "quickstart_compressed.server_app:app",
        "clientapp": "quickstart_compressed.client_app:app",
    }
    assert "federations" not in project["tool"]["flwr"]  # Flower 1.42 would rewrite them
    for name in ("__init__.py", "client_app.py", "server_app.py", "task.py"):
        assert (APP / "quickstart_compressed" / name).is_file()


def test_the_apps_use_the_readme_drop_in() -> None:
    client = (APP / "quickstart_compressed" / "client_app.py").read_text()
    server = (APP / "quickstart_compressed" / "server_app.py").read_text()
    assert "ClientApp(mods=[ternary_mod])" in client
    assert "TernaryDelta(\n        FedAvg(" in server


@needs_data
def test_the_task_gives_3x32x32_stratified_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(APP))
    import torch
    from quickstart_compressed.task import Net, load_data, partition

    x, y = partition(3, 10, 200)
    assert x.shape == (200, 3, 32, 32) and x.dtype == torch.float32
    assert float(x.min()) == -1.0 and float(x.max()) <= 1.0
    assert torch.bincount(y, minlength=10).tolist() == [20] * 10  # stratified
    other, _ = partition(4, 10, 200)
    assert not torch.equal(x, other)
    train, test = load_data(3, 10, 32, 200)
    assert (len(train.dataset), len(test.dataset)) == (160, 40)  # type: ignore[arg-type]
    assert Net()(x[:2]).shape == (2, 10)


@pytest.mark.e2e
@pytest.mark.slow
@needs_data
def test_flwr_run_finishes_and_compresses(tmp_path: Path) -> None:
    home = tmp_path / "flwr_home"
    home.mkdir()
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0")
    env.update(FLWR_DISABLE_UPDATE_CHECK="1", FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    cmd = [
        sys.executable, "-m", "fedddl", "run", "--app", str(APP),
        "--federation-config", "num-supernodes=4",
        "--run-config",
        "num-server-rounds=2 fraction-train=1.0 samples-per-client=200 test-samples=500",
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420, check=False
        )
    finally:
        left = pids_with_env("FLWR_HOME", str(home))
        stop_pids(left)  # only if the command under test failed to
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert left == [], f"processes of the run still alive: {left}"
    assert "nothing of this run is left running" in log
    trains = re.findall(
        r"fedddl: train: (\d+) messages, \d+ bytes down \(([\d.]+)x fewer than whole models\); "
        r"(\d+) replies, \d+ bytes up \(([\d.]+)x fewer",
        log,
    )
    assert len(trains) == 2, log[-3000:]  # one line a round
    for messages, _, replies, up in trains:
        assert int(messages) == 4 and int(replies) == 4  # every node trains
        assert float(up) >= 12, trains
    assert float(trains[1][1]) >= 8, trains  # round 2: every node holds the broadcast
    evaluations = re.findall(r"fedddl: evaluate: \d+ messages, \d+ bytes down \(([\d.]+)x", log)
    assert len(evaluations) == 2 and min(map(float, evaluations)) >= 8, evaluations
    assert re.search(r"central accuracy after round 2: 0\.\d+", log), log[-3000:]
