"""Checkpoint and resume with the ``grid`` downlink (in-process ``InlineGrid``, no Ray).

A run is "crashed" after m rounds (checkpoints every k, m not a multiple of k, so the
surviving clients are ahead of the checkpoint) and restarted from the directory with its old
clients and fresh ones; it must continue as the uninterrupted run does, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.checkpoint import CheckpointError, load_checkpoint
from fedddl.checkpoint_dir import checkpoint_path
from fedddl.flower.inline_grid import InlineGrid
from fedddl.sync import ReplicaServer
from strategies.server_app import run_server

NODES = 6
ROUNDS = 9


def _cfg(**changes: Any) -> AppConfig:
    base = AppConfig(
        dataset="digits", num_server_rounds=ROUNDS, min_available_nodes=NODES, downlink="grid"
    )
    return base.replace(**changes)


def _run(cfg: AppConfig, grid: InlineGrid | None = None) -> tuple[dict[str, Any], InlineGrid]:
    grid = grid if grid is not None else InlineGrid(make_client_app(cfg), NODES)
    return run_server(grid, cfg, progress=lambda line: None), grid


def _resumed(tmp_path: Path, **changes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(uninterrupted, resumed) runs of ``_cfg(**changes)``, checkpoints every 3 rounds,
    crashed after round 5, resumed with nodes 1000-1002 old and the others fresh."""
    uninterrupted, _ = _run(_cfg(**changes))
    ckpt_dir = str(tmp_path / "ckpt")
    cfg = _cfg(checkpoint_dir=ckpt_dir, checkpoint_every=3, **changes)
    crashed, old_grid = _run(cfg.replace(num_server_rounds=5))
    assert [r["round"] for r in crashed["rounds"]] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in Path(ckpt_dir).iterdir()) == ["round-000003.ckpt"]
    new_grid = InlineGrid(make_client_app(cfg), NODES)
    for node in (1000, 1001, 1002):
        new_grid.contexts[node] = old_grid.contexts[node]
    resumed, _ = _run(cfg, new_grid)
    assert resumed["resumed_from"]["round"] == 3
    return uninterrupted, resumed


def _same_trajectory(uninterrupted: dict[str, Any], resumed: dict[str, Any]) -> None:
    by_round = {r["round"]: r for r in uninterrupted["rounds"]}
    assert [r["round"] for r in resumed["rounds"]] == list(range(4, ROUNDS + 1))
    for r in resumed["rounds"]:
        old = by_round[r["round"]]
        assert r["replicas_equal"] is True and not r["dropped"], r
        assert r["downlink_format"] == "grid"
        for key in ("model_version", "accepted", "bytes_up", "loss", "accuracy"):
            assert r[key] == old[key], (r["round"], key)
    assert resumed["final_fingerprint"] == uninterrupted["final_fingerprint"] is not None
    assert resumed["final_version"] == uninterrupted["final_version"] == ROUNDS


def test_a_resumed_grid_run_continues_bit_for_bit(tmp_path: Path) -> None:
    uninterrupted, resumed = _resumed(tmp_path)
    _same_trajectory(uninterrupted, resumed)
    # Every node gets a snapshot at the first resumed round (the server forgot them all);
    # from then on every message is the uninterrupted run's.
    by_round = {r["round"]: r for r in uninterrupted["rounds"]}
    first, *rest = resumed["rounds"]
    assert first["bytes_down"] > by_round[4]["bytes_down"]
    assert [r["bytes_down"] for r in rest] == [by_round[r["round"]]["bytes_down"] for r in rest]
    assert uninterrupted["final_accuracy"] > 0.5  # it trained


def test_a_resumed_sampled_grid_run_continues_bit_for_bit(tmp_path: Path) -> None:
    uninterrupted, resumed = _resumed(tmp_path, fraction_train=0.5, downlink="auto")
    assert resumed["config"]["resolved-downlink"] == "grid"
    _same_trajectory(uninterrupted, resumed)


def test_the_checkpoint_holds_the_whole_grid_state(tmp_path: Path) -> None:
    ckpt_dir = str(tmp_path / "ckpt")
    cfg = _cfg(checkpoint_dir=ckpt_dir, checkpoint_every=4, grid_log_size=3, num_server_rounds=4)
    _run(cfg)
    ckpt = load_checkpoint(checkpoint_path(ckpt_dir, 4))
    assert ckpt.version == 4 and [v for v, _ in ckpt.update_log] == [2, 3, 4]  # the log's 3
    state = ckpt.strategy_state
    assert bytes(state["grid_snapshot"][:4]) == b"FDGS"
    names = [n for n, p in cfg.model_factory()().named_parameters() if p.requires_grad]
    assert list(state["grid_velocity"]) == names == list(state["grid_residuals"])
    assert set(state["grid_exponents"]) == set(names) and state["grid_rebased"] is False


def _grid_server(cfg: AppConfig) -> ReplicaServer:
    return ReplicaServer(cfg.model_factory(), downlink="grid", grid_log_size=cfg.grid_log_size)


def _tampered(tmp_path: Path, change: Any) -> Any:
    ckpt_dir = str(tmp_path / "ckpt")
    cfg = _cfg(checkpoint_dir=ckpt_dir, checkpoint_every=2, num_server_rounds=2)
    _run(cfg)
    ckpt = load_checkpoint(checkpoint_path(ckpt_dir, 2))
    ckpt.strategy_state["strategy_class"] = "fedddl.sync.server.ReplicaServer"  # the loader
    change(ckpt)
    return ckpt


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.strategy_state.pop("grid_snapshot"), "holds no grid state"),
        (
            lambda c: c.strategy_state.__setitem__("grid_snapshot", b"FDGS" + b"\0" * 64),
            "grid snapshot",
        ),
        (lambda c: setattr(c, "version", 7), "snapshot is at version 2"),
        (
            lambda c: c.strategy_state["grid_velocity"].__setitem__(
                next(iter(c.strategy_state["grid_velocity"])), torch.tensor([float("nan")])
            ),
            "grid_velocity",
        ),
        (
            lambda c: c.strategy_state["grid_residuals"].__setitem__(
                next(iter(c.strategy_state["grid_residuals"])),
                torch.full_like(
                    next(iter(c.strategy_state["grid_residuals"].values())), float("inf")
                ),
            ),
            "grid_residuals",
        ),
        (lambda c: c.strategy_state.__setitem__("grid_exponents", {"x": 0}), "grid_exponents"),
        (lambda c: c.strategy_state.__setitem__("grid_rebased", 1), "grid_rebased"),
        (lambda c: c.update_log.__setitem__(0, (1, b"junk")), "update log: version 1"),
        (lambda c: c.update_log.pop(), "update log ends at version 1"),
    ],
)
def test_a_bad_grid_checkpoint_is_refused_and_changes_nothing(
    tmp_path: Path, change: Any, message: str
) -> None:
    ckpt = _tampered(tmp_path, change)
    server = _grid_server(_cfg())
    before = server.shadow.fingerprint()
    with pytest.raises(CheckpointError, match=message):
        server.restore(ckpt)
    assert server.shadow.fingerprint() == before and server.round_offset == 0
    assert server.shadow.version == 0


def test_downlinks_do_not_resume_from_each_other(tmp_path: Path) -> None:
    grid_ckpt = _tampered(tmp_path, lambda c: None)
    other = ReplicaServer(_cfg().model_factory())  # reternarize
    with pytest.raises(CheckpointError, match="update log: version 1"):
        other.restore(grid_ckpt)
    reference = ReplicaServer(_cfg().model_factory()).checkpoint(1, {})
    with pytest.raises(CheckpointError, match="holds no grid state"):
        _grid_server(_cfg()).restore(reference)
