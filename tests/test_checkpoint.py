"""Tests for fedddl.checkpoint: round trip, atomicity, and clear errors on bad files."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedddl.checkpoint import (
    KEYED_FORMAT_VERSION,
    CheckpointError,
    ServerCheckpoint,
    load_checkpoint,
    save_checkpoint,
)
from fedddl.checkpoint_dir import (
    checkpoint_path,
    latest_checkpoint,
    load_latest_checkpoint,
    prune_checkpoints,
)


def _trained_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):  # fill momentum buffers and BN running stats
        optimizer.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def _checkpoint(round_: int = 7) -> ServerCheckpoint:
    model, optimizer = _trained_state()
    return ServerCheckpoint(
        round=round_,
        version=12,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        update_log=[(10, b"\x00\x01update-10"), (11, b"u11"), (12, bytes(range(256)))],
        config={"dataset": "digits", "strategy": "terngrad", "learning-rate": 0.1},
        rng_states={
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.default_rng(3).bit_generator.state,
        },
    )


def test_round_trip_restores_every_field_exactly(tmp_path: Path) -> None:
    original = _checkpoint()
    path = save_checkpoint(original, tmp_path / "ckpt" / "a.ckpt")
    loaded = load_checkpoint(path)

    assert (loaded.round, loaded.version) == (7, 12)
    assert loaded.update_log == original.update_log
    assert loaded.config == original.config
    assert loaded.created_unix == original.created_unix > 0
    assert loaded.model_state.keys() == original.model_state.keys()
    for key, value in original.model_state.items():
        assert torch.equal(loaded.model_state[key], value), key

    # Optimizer state restores into a fresh optimizer and continues identically.
    model_a, opt_a = _trained_state()
    model_b = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    loaded.restore_model(model_b)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    opt_b.load_state_dict(loaded.optimizer_state)
    batch = torch.randn(16, 8)
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)

    # RNG states restore the same streams.
    assert loaded.rng_states is not None
    torch.set_rng_state(loaded.rng_states["torch"])
    first = torch.rand(3)
    torch.set_rng_state(original.rng_states["torch"])  # type: ignore[index]
    assert torch.equal(first, torch.rand(3))
    random.setstate(loaded.rng_states["python"])
    x = random.random()
    random.setstate(original.rng_states["python"])  # type: ignore[index]
    assert x == random.random()
    gen = np.random.default_rng()
    gen.bit_generator.state = loaded.rng_states["numpy"]
    assert gen.integers(1 << 30) == np.random.default_rng(3).integers(1 << 30)


def test_save_replaces_atomically_and_leaves_no_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "server.ckpt"
    save_checkpoint(_checkpoint(round_=1), target)

    # A crash during the write (here: fsync fails) must leave the old file intact.
    def broken_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(_checkpoint(round_=2), target)
    monkeypatch.undo()

    assert load_checkpoint(target).round == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.ckpt"]

    save_checkpoint(_checkpoint(round_=3), target)
    assert load_checkpoint(target).round == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.ckpt"]


@pytest.mark.parametrize("cut", [0, 10, 51, -1, -100])
def test_truncated_file_is_rejected(tmp_path: Path, cut: int) -> None:
    path = save_checkpoint(_checkpoint(), tmp_path / "c.ckpt")
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


def test_flipped_byte_fails_checksum(tmp_path: Path) -> None:
    path = save_checkpoint(_checkpoint(), tmp_path / "c.ckpt")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)


def test_wrong_magic_and_future_format_are_rejected(tmp_path: Path) -> None:
    path = save_checkpoint(_checkpoint(), tmp_path / "c.ckpt")
    data = path.read_bytes()
    (tmp_path / "other.bin").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(CheckpointError, match="bad magic"):
        load_checkpoint(tmp_path / "other.bin")
    future = data[:8] + struct.pack(">I", KEYED_FORMAT_VERSION + 1) + data[12:]
    (tmp_path / "future.ckpt").write_bytes(future)
    with pytest.raises(CheckpointError, match="format version"):
        load_checkpoint(tmp_path / "future.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.ckpt")


def test_unsafe_content_is_refused_at_save(tmp_path: Path) -> None:
    ckpt = _checkpoint()
    ckpt.rng_states = {"numpy_legacy": np.random.get_state()}
    with pytest.raises(CheckpointError, match="ndarray"):
        save_checkpoint(ckpt, tmp_path / "c.ckpt")
    assert not list(tmp_path.iterdir())


def test_invalid_update_log_is_rejected() -> None:
    model, _ = _trained_state()
    with pytest.raises(ValueError, match="increase"):
        ServerCheckpoint(round=1, version=5, model_state=model.state_dict(),
                         update_log=[(3, b"a"), (3, b"b")])
    with pytest.raises(ValueError, match="newer"):
        ServerCheckpoint(round=1, version=2, model_state=model.state_dict(),
                         update_log=[(3, b"a")])


def test_config_and_model_compatibility_checks() -> None:
    ckpt = _checkpoint()
    ckpt.check_config({"dataset": "digits", "strategy": "terngrad"}, ["dataset", "strategy"])
    with pytest.raises(CheckpointError, match="dataset: checkpoint 'digits', run 'mnist'"):
        ckpt.check_config({"dataset": "mnist", "strategy": "terngrad"}, ["dataset"])
    with pytest.raises(CheckpointError, match="wrong shape"):
        ckpt.restore_model(torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.BatchNorm1d(5)))
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.restore_model(torch.nn.Sequential(torch.nn.Linear(8, 4)))


def test_latest_prune_and_skip_corrupt(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert load_latest_checkpoint(tmp_path / "nowhere") is None
    for r in (2, 10, 4):
        save_checkpoint(_checkpoint(round_=r), checkpoint_path(tmp_path, r))
    (tmp_path / "notes.txt").write_text("ignored")
    assert latest_checkpoint(tmp_path) == tmp_path / "round-000010.ckpt"

    newest = tmp_path / "round-000010.ckpt"
    newest.write_bytes(newest.read_bytes()[:-5])
    found = load_latest_checkpoint(tmp_path)
    assert found is not None and found[1].round == 4
    with pytest.raises(CheckpointError):
        load_latest_checkpoint(tmp_path, skip_corrupt=False)

    deleted = prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in deleted) == ["round-000002.ckpt", "round-000004.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "round-000010.ckpt"]
