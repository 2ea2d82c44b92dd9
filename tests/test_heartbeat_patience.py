"""fedddl.flower.heartbeat_patience: Flower's heartbeat patience raised in-process."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from fedddl.deploy.processes import start_supernode
from fedddl.flower.heartbeat_patience import MODULES, patch_heartbeat_patience


def test_patch_sets_the_patience_every_state_module_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    modules = [importlib.import_module(name) for name in MODULES]
    for module in modules:  # restored after the test
        monkeypatch.setattr(module, "HEARTBEAT_PATIENCE", module.HEARTBEAT_PATIENCE)
    assert all(module.HEARTBEAT_PATIENCE == 2 for module in modules)  # Flower's
    assert patch_heartbeat_patience(10) == list(MODULES)
    assert all(module.HEARTBEAT_PATIENCE == 10 for module in modules)


def test_patch_refuses_nonsense_and_a_flower_without_the_constant(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="patience"):
            patch_heartbeat_patience(bad)  # type: ignore[arg-type]
    module = importlib.import_module(MODULES[0])
    monkeypatch.delattr(module, "HEARTBEAT_PATIENCE")
    other = importlib.import_module(MODULES[1])
    monkeypatch.setattr(other, "HEARTBEAT_PATIENCE", other.HEARTBEAT_PATIENCE)
    with pytest.raises(RuntimeError, match="no HEARTBEAT_PATIENCE"):
        patch_heartbeat_patience(5)
    assert other.HEARTBEAT_PATIENCE == 2  # nothing patched when one module is missing it


def test_supernode_patience_needs_the_fast_launcher(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fast SuperNode launcher"):
        start_supernode("n", "127.0.0.1:1", tmp_path, env={}, poll_interval_s=None,
                        heartbeat_patience=5, warm_clientapp_preload=None)
