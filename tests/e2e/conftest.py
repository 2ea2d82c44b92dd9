"""Fixtures for end-to-end tests that start real Flower processes.

Every process started through :class:`ProcessRegistry` is stopped (with its
whole process tree) when the test ends, also when it fails. Ports are picked
free at runtime; every test gets its own ``FLWR_HOME``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedddl.deploy.processes import ProcessRegistry, flower_env

LATENCY_APP_DIR = Path(__file__).parent / "latency_app"


def _flower_installed() -> bool:
    path = flower_env()["PATH"]
    return all(
        shutil.which(cmd, path=path)
        for cmd in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr")
    )


@pytest.fixture
def latency_app_dir() -> Path:
    """The tiny FedAvg app used by the deployment tests."""
    return LATENCY_APP_DIR


@pytest.fixture
def flwr_home(tmp_path: Path) -> Path:
    """A private FLWR_HOME for this test."""
    home = tmp_path / "flwr_home"
    home.mkdir()
    return home


@pytest.fixture
def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: offline, no telemetry, private FLWR_HOME."""
    if not _flower_installed():
        pytest.skip("Flower command line tools are not installed")
    return flower_env(flwr_home)


@pytest.fixture
def processes(request: pytest.FixtureRequest) -> Iterator[ProcessRegistry]:
    """Registry whose processes are all stopped at teardown, pass or fail."""
    registry = ProcessRegistry()
    request.addfinalizer(registry.stop_all)
    yield registry
