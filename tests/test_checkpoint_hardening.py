"""Hardened checkpoints: HMAC authentication, logged skips, no silent fresh start, loaded
state validated before use, and a resume check of every setting that changes the run."""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.checkpoint import CheckpointError, load_checkpoint, read_key_file, save_checkpoint
from fedddl.checkpoint_dir import checkpoint_path, load_latest_checkpoint
from fedddl.flower.inline_grid import InlineGrid
from strategies.server_app import RESUME_CHECK_KEYS, RESUME_IGNORED_KEYS, run_server
from tests.test_sync_server import Cluster

KEY = b"0123456789abcdef-secret"
NODES = 3


@pytest.fixture(scope="module")
def trained() -> Cluster:
    cluster = Cluster()
    for _ in range(3):
        cluster.step()
    return cluster


def _forge(path: Path, change: Any) -> None:
    """Rewrite a (plain, format 1) checkpoint's payload and re-hash it, as an attacker can."""
    data = path.read_bytes()
    payload = torch.load(io.BytesIO(data[52:]), weights_only=True)
    change(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    header = struct.pack(">8sIQ32s", data[:8], 1, len(body), hashlib.sha256(body).digest())
    path.write_bytes(header + body)


def test_hmac_authenticates_checkpoints(tmp_path: Path, trained: Cluster) -> None:
    ckpt = trained.server.checkpoint(3, {})
    keyed = save_checkpoint(ckpt, tmp_path / "keyed.ckpt", key=KEY)
    assert load_checkpoint(keyed, key=KEY).version == 3
    with pytest.raises(CheckpointError, match="set checkpoint-key-file"):
        load_checkpoint(keyed)
    with pytest.raises(CheckpointError, match="fails authentication"):
        load_checkpoint(keyed, key=b"another key of 16+ bytes")
    plain = save_checkpoint(ckpt, tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointError, match="not authenticated"):
        load_checkpoint(plain, key=KEY)
    # A crafted, correctly re-hashed file passes the plain checksum, never the HMAC.
    _forge(plain, lambda p: p["model_state"]["1.bias"].fill_(7.0))
    assert float(load_checkpoint(plain).model_state["1.bias"][0]) == 7.0
    data = bytearray(keyed.read_bytes())
    data[-10] ^= 0x01
    keyed.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="HMAC mismatch"):
        load_checkpoint(keyed, key=KEY)
    short = tmp_path / "short.key"
    short.write_bytes(b"too short\n")
    with pytest.raises(CheckpointError, match="at least 16 bytes"):
        read_key_file(short)
    good = tmp_path / "good.key"
    good.write_bytes(KEY + b"\n")
    assert read_key_file(good) == KEY


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda p: p["model_state"]["1.weight"].fill_(float("nan")), "non-finite"),
        (
            lambda p: p["optimizer_state"]["state"][0].update(momentum_buffer=torch.zeros(3, 3)),
            "momentum buffer",
        ),
        (
            lambda p: p["optimizer_state"]["state"][1]["momentum_buffer"].fill_(float("inf")),
            "momentum buffer",
        ),
        (lambda p: p["strategy_state"].update(shared_scales=torch.ones(2)), "shared_scales"),
        (
            lambda p: p["strategy_state"].update(server_memory={"1.bias": torch.zeros(7)}),
            "server_memory",
        ),
        (lambda p: p.update(update_log=[(3, b"E" + b"junk")]), "update log: version 3"),
        (
            lambda p: p["strategy_state"].update(scale_bound={"history": [{"w": [-1.0]}]}),
            "scale_bound",
        ),
    ],
)
def test_a_crafted_checkpoint_is_refused_and_changes_nothing(
    tmp_path: Path, trained: Cluster, change: Any, reason: str
) -> None:
    path = save_checkpoint(trained.server.checkpoint(3, {}), tmp_path / "c.ckpt")
    _forge(path, change)
    fresh = Cluster()
    before = fresh.server.shadow.fingerprint()
    with pytest.raises(CheckpointError, match=reason):
        fresh.server.restore(load_checkpoint(path))
    assert fresh.server.shadow.fingerprint() == before and fresh.server.shadow.version == 0


def test_restore_keeps_the_scale_bound_history(trained: Cluster) -> None:
    fresh = Cluster()
    fresh.server.restore(trained.server.checkpoint(3, {}))
    assert fresh.server.scale_bound.state() == trained.server.scale_bound.state()
    assert len(fresh.server.scale_bound.history) == 3


def test_skipped_checkpoints_are_logged_and_none_readable_stops_the_run(
    tmp_path: Path, trained: Cluster, fedddl_warnings: list[str]
) -> None:
    for r in (2, 4):
        save_checkpoint(trained.server.checkpoint(r, {}), checkpoint_path(tmp_path, r))
    newest = checkpoint_path(tmp_path, 4)
    newest.write_bytes(newest.read_bytes()[:-3])
    found = load_latest_checkpoint(tmp_path)
    assert found is not None and found[1].round == 2
    assert any("skipping checkpoint" in w and "round-000004" in w and "truncated" in w
               for w in fedddl_warnings), fedddl_warnings
    oldest = checkpoint_path(tmp_path, 2)
    oldest.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="none of the 2 checkpoint"):
        load_latest_checkpoint(tmp_path)
    assert load_latest_checkpoint(tmp_path, allow_fresh_start=True) is None
    assert any("starting from round 0" in w for w in fedddl_warnings)
    assert load_latest_checkpoint(tmp_path / "empty") is None  # no files: a fresh start


def _cfg(ckpt_dir: Path, **changes: Any) -> AppConfig:
    return AppConfig(
        num_server_rounds=2,
        min_available_nodes=NODES,
        checkpoint_dir=str(ckpt_dir),
        checkpoint_every=1,
    ).replace(**changes)


def _run(cfg: AppConfig) -> dict[str, Any]:
    return run_server(InlineGrid(make_client_app(cfg), NODES), cfg, progress=lambda line: None)


def test_run_server_with_a_key_unreadable_checkpoints_and_changed_settings(
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "ckpt.key"
    key_file.write_bytes(KEY)
    ckpt_dir = tmp_path / "ckpt"
    cfg = _cfg(ckpt_dir, checkpoint_key_file=str(key_file))
    _run(cfg)
    assert load_checkpoint(checkpoint_path(ckpt_dir, 2), key=KEY).round == 2
    resumed = _run(cfg.replace(num_server_rounds=3))  # rounds may change
    assert resumed["resumed_from"]["round"] == 2 and [r["round"] for r in resumed["rounds"]] == [3]
    for changed, key in [
        ({"batch_size": 16}, "batch-size"),
        ({"downlink": "shared-scale-sum"}, "downlink"),
        ({"aggregator": "median"}, "aggregator"),
        ({"scale_bound": 4.0}, "scale-bound"),
    ]:
        with pytest.raises(CheckpointError, match=key):
            _run(cfg.replace(num_server_rounds=4, **changed))
    with pytest.raises(CheckpointError, match="set checkpoint-key-file"):
        _run(cfg.replace(num_server_rounds=4, checkpoint_key_file=""))
    for path in ckpt_dir.iterdir():
        path.write_bytes(b"corrupt")
    with pytest.raises(CheckpointError, match="checkpoint-allow-fresh-start"):
        _run(cfg.replace(num_server_rounds=4))
    fresh = _run(cfg.replace(num_server_rounds=1, checkpoint_allow_fresh_start=True))
    assert fresh["resumed_from"] is None and [r["round"] for r in fresh["rounds"]] == [1]


def test_resume_check_covers_every_setting_that_changes_the_trajectory() -> None:
    everything = set(AppConfig().to_run_config())
    assert set(RESUME_CHECK_KEYS) == everything - RESUME_IGNORED_KEYS
    for key in ("batch-size", "downlink", "local-steps", "fraction-train", "clip-sigma",
                "error-feedback", "update-log-size", "aggregator", "scale-bound", "attack"):
        assert key in RESUME_CHECK_KEYS
    # A checkpoint older than a key counts as that key's default.
    from fedddl.checkpoint import ServerCheckpoint

    old = ServerCheckpoint(round=1, version=1, model_state={}, config={"dataset": "digits"})
    old.check_config(AppConfig().to_run_config(), RESUME_CHECK_KEYS, AppConfig().to_run_config())
    with pytest.raises(CheckpointError, match="aggregator: checkpoint 'mean', run 'median'"):
        old.check_config(
            AppConfig(aggregator="median").to_run_config(),
            RESUME_CHECK_KEYS,
            AppConfig().to_run_config(),
        )
