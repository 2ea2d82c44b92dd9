"""Checkpoint and resume of the ServerApp, in-process (``InlineGrid``, no Ray).

A run of R rounds is compared with the same run "crashed" after m rounds
(checkpoints every k rounds, m not a multiple of k, so surviving clients are
*ahead* of the checkpoint) and restarted from the checkpoint directory with a mix
of fresh clients (empty ``context.state``) and old clients (state kept).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message

from clients.client_app import make_client_app
from clients.state import load_state
from fedddl.app_config import AppConfig
from fedddl.checkpoint import CheckpointError, load_checkpoint
from fedddl.checkpoint_dir import checkpoint_path
from fedddl.flower.inline_grid import InlineGrid
from strategies.server_app import run_server

NODES = 4


def _cfg(**changes: Any) -> AppConfig:
    return AppConfig(num_server_rounds=8, min_available_nodes=NODES).replace(**changes)


def _run(cfg: AppConfig, grid: InlineGrid | None = None) -> tuple[dict[str, Any], InlineGrid]:
    grid = grid if grid is not None else InlineGrid(make_client_app(cfg), NODES, keep_sent=True)
    return run_server(grid, cfg, progress=lambda line: None), grid


def _round_of(message: Message) -> int:
    return int(message.content.config_records["config"]["server-round"])  # type: ignore[arg-type]


def _client_versions(grid: InlineGrid, cfg: AppConfig) -> dict[int, int]:
    out = {}
    for node, ctx in grid.contexts.items():
        st = load_state(
            ctx.state, cfg.model_factory(), cfg.learning_rate, cfg.momentum
        )
        out[node] = -1 if st.replica is None else st.replica.version
    return out


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    result, _ = _run(_cfg())
    return result


def test_resume_continues_the_run_with_fresh_and_old_clients(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    ckpt_dir = str(tmp_path / "ckpt")
    cfg = _cfg(checkpoint_dir=ckpt_dir, checkpoint_every=3, checkpoint_keep=2)
    # "Crash" after round 5: checkpoints exist for round 3 only.
    crashed, old_grid = _run(cfg.replace(num_server_rounds=5))
    assert [r["round"] for r in crashed["rounds"]] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in Path(ckpt_dir).iterdir()) == ["round-000003.ckpt"]
    ckpt = load_checkpoint(checkpoint_path(ckpt_dir, 3))
    assert ckpt.round == 3 and ckpt.version == 3 and [v for v, _ in ckpt.update_log] == [1, 2, 3]
    # Clients got round 4's aggregate with round 5's message: they are ahead of the checkpoint.
    assert set(_client_versions(old_grid, cfg).values()) == {4}

    # Restart: nodes 1000 and 1001 are the old ones (state kept), 1002 and 1003 are fresh.
    new_grid = InlineGrid(make_client_app(cfg), NODES, keep_sent=True)
    for node in (1000, 1001):
        new_grid.contexts[node] = old_grid.contexts[node]
    resumed, _ = _run(cfg, new_grid)

    assert resumed["resumed_from"]["round"] == 3 and resumed["resumed_from"]["version"] == 3
    assert [r["round"] for r in resumed["rounds"]] == [4, 5, 6, 7, 8]
    assert [r["model_version"] for r in resumed["rounds"]] == [4, 5, 6, 7, 8]
    # Every reply of every resumed round came from a replica equal to the shadow.
    for r in resumed["rounds"]:
        assert r["replicas_equal"] is True and r["accepted"] == NODES and not r["dropped"], r
    # First message after the restart: a snapshot for everyone (old clients are ahead);
    # afterwards, one logged update per message.
    for m in new_grid.sent:
        has_snapshot = "snapshot" in m.content.array_records
        assert has_snapshot == (_round_of(m) == 4), (m.metadata.dst_node_id, _round_of(m))
    assert {_round_of(m) for m in new_grid.sent} == {4, 5, 6, 7, 8}
    # Checkpoints: round 6 written, only the 2 newest kept.
    assert sorted(p.name for p in Path(ckpt_dir).iterdir()) == [
        "round-000003.ckpt",
        "round-000006.ckpt",
    ]
    # Everything is seeded by the global round and the restored state is complete
    # (weights, momentum, log, server residuals), so the run continues bit for bit.
    assert resumed["final_version"] == uninterrupted["final_version"] == 8
    assert resumed["final_fingerprint"] == uninterrupted["final_fingerprint"]
    assert resumed["final_accuracy"] == uninterrupted["final_accuracy"]
    by_round = {r["round"]: r for r in uninterrupted["rounds"]}
    for r in resumed["rounds"]:
        assert r["accuracy"] == by_round[r["round"]]["accuracy"]
    assert uninterrupted["final_accuracy"] > 0.5  # it trained


def test_resume_is_refused_when_a_checked_setting_changed(tmp_path: Path) -> None:
    ckpt_dir = str(tmp_path / "ckpt")
    cfg = _cfg(num_server_rounds=2, checkpoint_dir=ckpt_dir, checkpoint_every=2)
    _run(cfg)
    before = (Path(ckpt_dir) / "round-000002.ckpt").read_bytes()
    with pytest.raises(CheckpointError, match="learning-rate"):
        _run(cfg.replace(num_server_rounds=4, learning_rate=0.05))
    assert sorted(p.name for p in Path(ckpt_dir).iterdir()) == ["round-000002.ckpt"]
    assert (Path(ckpt_dir) / "round-000002.ckpt").read_bytes() == before


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    cfg = _cfg(num_server_rounds=4, checkpoint_dir=str(ckpt_dir), checkpoint_every=2)
    _run(cfg)
    newest = ckpt_dir / "round-000004.ckpt"
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF
    newest.write_bytes(bytes(data))
    resumed, _ = _run(cfg.replace(num_server_rounds=5))
    assert resumed["resumed_from"]["round"] == 2
    assert [r["round"] for r in resumed["rounds"]] == [3, 4, 5]
    assert all(r["replicas_equal"] for r in resumed["rounds"])


def test_nothing_left_to_run_and_bad_settings(tmp_path: Path) -> None:
    ckpt_dir = str(tmp_path / "ckpt")
    cfg = _cfg(num_server_rounds=2, checkpoint_dir=ckpt_dir, checkpoint_every=1)
    first, _ = _run(cfg)
    again, grid = _run(cfg)
    assert again["resumed_from"]["round"] == 2 and again["rounds"] == []
    assert again["final_fingerprint"] == first["final_fingerprint"]
    assert grid.sent == []
    with pytest.raises(ValueError, match="checkpoint-dir"):
        AppConfig(checkpoint_every=2)
    with pytest.raises(ValueError, match="checkpoint-keep"):
        AppConfig(checkpoint_keep=0)
    with pytest.raises(ValueError, match="TernGrad-family"):
        _run(_cfg(strategy="fedavg", checkpoint_dir=ckpt_dir, checkpoint_every=1))


def test_only_the_deployment_grid_gets_fast_polling() -> None:
    """``run_server`` wraps Flower's ``HttpGrid`` (3 s polls) in ``FastPollGrid``; the
    simulation's and the inline engine's own ``send_and_receive`` are kept (``InlineGrid``
    has no push/pull at all)."""
    from flwr.superlink.grid.http_grid import HttpGrid

    from fedddl.flower.grid import FastPollGrid
    from fedddl.flower.grid import fast_poll as _fast_poll

    http = HttpGrid(token="not-connected")  # connects lazily: nothing is contacted here
    wrapped = _fast_poll(http)
    assert isinstance(wrapped, FastPollGrid) and wrapped.inner is http
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from fedddl.flower.grid import SIMULATION_POLL_INTERVAL_S

    memory = InMemoryGrid.__new__(InMemoryGrid)  # the simulation's grid (not connected)
    polled = _fast_poll(memory)
    assert isinstance(polled, FastPollGrid) and polled.inner is memory
    assert polled.poll_interval_s == SIMULATION_POLL_INTERVAL_S
    inline = InlineGrid(make_client_app(_cfg()), 1)
    assert _fast_poll(inline) is inline
