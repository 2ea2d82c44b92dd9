"""Checkpoint rollbacks and absurd checkpoints: a renamed older file, the newest deleted, a
forged or missing high-water mark, another run's file (with a key); weights x1000, a
scale-bound history of 3e38, round 1e6 and a renamed file (without one)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fedddl.checkpoint_dir import checkpoint_path, load_latest_checkpoint
from fedddl.checkpoint_mark import MARK_NAME, HighWaterMark, read_mark, write_mark
from fedddl.flower.inline_grid import InlineGrid
from strategies.server_app import run_server
from tests.test_checkpoint_hardening import KEY, _forge
from tests.test_sync_server import Cluster

NODES = 3
ROUNDS = 4


def _cfg(ckpt_dir: Path, key_file: Path, **changes: Any) -> AppConfig:
    return AppConfig(
        num_server_rounds=ROUNDS,
        min_available_nodes=NODES,
        checkpoint_dir=str(ckpt_dir),
        checkpoint_every=1,
        checkpoint_keep=ROUNDS,
        checkpoint_key_file=str(key_file),
    ).replace(**changes)


def _run(cfg: AppConfig) -> dict[str, Any]:
    return run_server(InlineGrid(make_client_app(cfg), NODES), cfg, progress=lambda line: None)


@pytest.fixture(scope="module")
def keyed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished keyed run: checkpoints of rounds 1..ROUNDS and the key file."""
    root = tmp_path_factory.mktemp("keyed")
    key_file = root / "ckpt.key"
    key_file.write_bytes(KEY)
    _run(_cfg(root / "ckpt", key_file))
    return root / "ckpt", key_file


@pytest.fixture()
def run_dir(tmp_path: Path, keyed_run: tuple[Path, Path]) -> tuple[Path, Path]:
    """A copy of the keyed run's checkpoint directory, to tamper with."""
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(keyed_run[0], ckpt_dir)
    return ckpt_dir, keyed_run[1]


def test_a_keyed_run_keeps_a_high_water_mark_and_a_run_id_under_the_mac(
    keyed_run: tuple[Path, Path],
) -> None:
    ckpt_dir, _ = keyed_run
    mark = read_mark(ckpt_dir, KEY)
    assert mark is not None and mark.round == ROUNDS
    for r in range(1, ROUNDS + 1):
        assert load_checkpoint(checkpoint_path(ckpt_dir, r), key=KEY).run_id == mark.run_id
    with pytest.raises(CheckpointError, match="fails authentication"):
        read_mark(ckpt_dir, b"another key of 16+ bytes")


def test_an_older_authentic_checkpoint_under_the_newest_name_is_refused(
    run_dir: tuple[Path, Path], keyed_run: tuple[Path, Path], fedddl_warnings: list[str]
) -> None:
    ckpt_dir, key_file = run_dir
    shutil.copyfile(checkpoint_path(ckpt_dir, 2), checkpoint_path(ckpt_dir, ROUNDS))
    with pytest.raises(CheckpointError, match=rf"round {ROUNDS - 1}, but .* round {ROUNDS}"):
        _run(_cfg(ckpt_dir, key_file, num_server_rounds=ROUNDS + 1))
    assert any(
        f"round-{ROUNDS:06d}" in w and "holds round 2, its name says round 4" in w
        for w in fedddl_warnings
    ), fedddl_warnings
    assert read_mark(ckpt_dir, KEY) == read_mark(keyed_run[0], KEY)  # nothing was written


def test_deleting_the_newest_checkpoint_is_refused_or_logged_with_the_rounds(
    run_dir: tuple[Path, Path], fedddl_warnings: list[str]
) -> None:
    ckpt_dir, key_file = run_dir
    checkpoint_path(ckpt_dir, ROUNDS).unlink()
    with pytest.raises(CheckpointError, match="checkpoint-allow-fresh-start") as refused:
        _run(_cfg(ckpt_dir, key_file, num_server_rounds=ROUNDS + 1))
    assert f"round {ROUNDS - 1}, but the high-water mark records round {ROUNDS}" in str(
        refused.value
    )
    resumed = _run(
        _cfg(ckpt_dir, key_file, num_server_rounds=ROUNDS + 1, checkpoint_allow_fresh_start=True)
    )
    assert resumed["resumed_from"]["round"] == ROUNDS - 1
    assert any(
        f"is round {ROUNDS - 1}, but the high-water mark records round {ROUNDS}" in w
        and f"resuming from round {ROUNDS - 1}" in w
        for w in fedddl_warnings
    ), fedddl_warnings


def test_deleting_every_checkpoint_or_the_mark_is_refused(run_dir: tuple[Path, Path]) -> None:
    ckpt_dir, key_file = run_dir
    (ckpt_dir / MARK_NAME).unlink()
    with pytest.raises(CheckpointError, match="has no high-water mark"):
        load_latest_checkpoint(ckpt_dir, key=KEY)
    write_mark(ckpt_dir, HighWaterMark("00" * 16, ROUNDS), KEY)  # back, and every file gone
    for r in range(1, ROUNDS + 1):
        checkpoint_path(ckpt_dir, r).unlink()
    with pytest.raises(CheckpointError, match=f"records round {ROUNDS}, but no checkpoint"):
        _run(_cfg(ckpt_dir, key_file, num_server_rounds=ROUNDS + 1))


def test_a_forged_mark_is_refused(run_dir: tuple[Path, Path]) -> None:
    ckpt_dir, _ = run_dir
    write_mark(ckpt_dir, HighWaterMark("00" * 16, 1), b"the attacker's own 16+ byte key")
    with pytest.raises(CheckpointError, match=r"high-water mark .* fails authentication"):
        load_latest_checkpoint(ckpt_dir, key=KEY)


def test_a_checkpoint_of_another_run_is_skipped(
    run_dir: tuple[Path, Path], tmp_path: Path, fedddl_warnings: list[str]
) -> None:
    ckpt_dir, key_file = run_dir
    other = _cfg(tmp_path / "other", key_file, num_server_rounds=ROUNDS + 1)
    _run(other)  # another run, same key: its newest round is newer than this run's
    shutil.copyfile(
        checkpoint_path(tmp_path / "other", ROUNDS + 1), checkpoint_path(ckpt_dir, ROUNDS + 1)
    )
    found = load_latest_checkpoint(ckpt_dir, key=KEY)
    assert found is not None and found[1].round == ROUNDS
    assert any("was written by run" in w for w in fedddl_warnings), fedddl_warnings


# ----------------------------------------------------------------- without a key


@pytest.fixture(scope="module")
def trained() -> Cluster:
    cluster = Cluster()
    for _ in range(3):
        cluster.step()
    return cluster


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            lambda p: [t.mul_(1000) for t in p["model_state"].values() if t.is_floating_point()],
            r"model weight .* more than 100 x",
        ),
        (
            lambda p: p["strategy_state"].update(
                scale_bound={"history": [{name: [3e38] for name in p["model_state"]}]}
            ),
            r"scale-bound history .* bad scale: .* outside \[0, 1e\+06\]",
        ),
    ],
    ids=["weights x1000", "scale-bound history 3e38"],
)
def test_absurd_rehashed_checkpoints_are_refused_without_a_key(
    tmp_path: Path, trained: Cluster, change: Any, reason: str
) -> None:
    path = save_checkpoint(trained.server.checkpoint(3, {}), checkpoint_path(tmp_path, 3))
    Cluster().server.restore(load_checkpoint(path))  # the honest file restores
    _forge(path, change)
    fresh = Cluster()
    before = fresh.server.shadow.fingerprint()
    with pytest.raises(CheckpointError, match=reason):
        fresh.server.restore(load_checkpoint(path))
    assert fresh.server.shadow.fingerprint() == before


def test_round_1e6_and_a_renamed_file_are_refused_without_a_key(
    tmp_path: Path, trained: Cluster, fedddl_warnings: list[str]
) -> None:
    far = save_checkpoint(trained.server.checkpoint(3, {}), checkpoint_path(tmp_path, 1_000_000))
    _forge(far, lambda p: p.update(round=1_000_000))
    assert load_checkpoint(far).round == 1_000_000  # well formed, correctly re-hashed
    with pytest.raises(CheckpointError, match="round 1000000, beyond the run's 30 rounds"):
        load_latest_checkpoint(tmp_path, max_round=30)
    far.unlink()
    renamed = save_checkpoint(trained.server.checkpoint(3, {}), checkpoint_path(tmp_path, 9))
    with pytest.raises(CheckpointError, match="holds round 3, its name says round 9"):
        load_checkpoint(renamed)
    save_checkpoint(trained.server.checkpoint(2, {}), checkpoint_path(tmp_path, 2))
    found = load_latest_checkpoint(tmp_path, max_round=30)
    assert found is not None and found[1].round == 2  # without a key: not a refused rollback
    assert any("its name says round 9" in w for w in fedddl_warnings), fedddl_warnings
