"""Server checkpoints: atomic save and verified load of the ServerApp's state.

A :class:`ServerCheckpoint` holds everything a restarted ServerApp needs to
continue a run where it stopped: the round, the update version, the shadow
replica's ``state_dict``, the optimizer's ``state_dict``, the bounded update
log (``(version, encoded update bytes)`` pairs that lagging clients replay),
the run config, optionally RNG states and further strategy state.

File layout (all integers big-endian)::

    magic      8 bytes  b"FDDLCKPT"
    format     4 bytes  uint32, CHECKPOINT_FORMAT_VERSION
    length     8 bytes  uint64, payload length
    sha256    32 bytes  of the payload
    payload    torch.save of a dict of plain types and tensors

Saving writes a temporary file in the target directory, fsyncs it and
``os.replace``-s it over the target (then fsyncs the directory), so a crash
leaves either the old or the new checkpoint, never a torn one. Loading checks
magic, format version, length and checksum before unpickling, and unpickles
with ``torch.load(weights_only=True)`` so a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import struct
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedddl.framing import check_magic

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "CheckpointError",
    "ServerCheckpoint",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "load_latest_checkpoint",
    "prune_checkpoints",
    "save_checkpoint",
]

CHECKPOINT_FORMAT_VERSION = 1
_MAGIC = b"FDDLCKPT"
_HEADER = struct.Struct(">8sIQ32s")
_NAME_RE = re.compile(r"^round-(\d{6,})\.ckpt$")

# Types a checkpoint may contain: what torch.load(weights_only=True) restores.
_SCALARS = (type(None), bool, int, float, str, bytes)


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or incompatible."""


@dataclass
class ServerCheckpoint:
    """Everything a ServerApp needs to resume a run.

    Attributes
    ----------
    round : int
        Last completed server round (the resumed run starts at ``round + 1``).
    version : int
        Version of the last update applied to the shadow replica.
    model_state : dict
        ``state_dict`` of the shadow replica.
    optimizer_state : dict
        ``state_dict`` of the server-side optimizer (may be empty).
    update_log : list of (int, bytes)
        The bounded log of encoded updates, oldest first, versions increasing.
    config : dict
        Run config the checkpoint was made with (checked on resume).
    rng_states : dict, optional
        Named RNG states, e.g. ``{"torch": torch.get_rng_state(),
        "python": random.getstate(), "numpy": gen.bit_generator.state}``.
    created_unix : float
        Wall-clock time of saving.
    strategy_state : dict
        Further strategy state needed for an exact continuation (e.g. TernGrad's
        server-side error-feedback residuals and shared scales); plain types and tensors.
    """

    round: int
    version: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] = field(default_factory=dict)
    update_log: list[tuple[int, bytes]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    rng_states: dict[str, Any] | None = None
    created_unix: float = 0.0
    strategy_state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.round < 0:
            raise ValueError(f"round must be >= 0, got {self.round}")
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")
        previous = -1
        for entry in self.update_log:
            if len(entry) != 2 or not isinstance(entry[0], int) or not isinstance(
                entry[1], bytes
            ):
                raise ValueError("update_log entries must be (int version, bytes update)")
            if entry[0] <= previous:
                raise ValueError(
                    f"update_log versions must increase, got {entry[0]} after {previous}"
                )
            previous = entry[0]
        if self.update_log and self.update_log[-1][0] > self.version:
            raise ValueError(
                f"update_log holds version {self.update_log[-1][0]} newer than "
                f"the checkpoint version {self.version}"
            )

    def check_config(self, config: Mapping[str, Any], keys: Sequence[str]) -> None:
        """Raise :class:`CheckpointError` if ``config`` differs from the saved one on ``keys``.

        Use it on resume for settings that must not change mid-run
        (dataset, model, strategy, compressor, number of clients, ...).
        """
        differences = [
            f"{key}: checkpoint {self.config.get(key)!r}, run {config.get(key)!r}"
            for key in keys
            if self.config.get(key) != config.get(key)
        ]
        if differences:
            raise CheckpointError(
                "checkpoint is incompatible with this run: " + "; ".join(differences)
            )

    def restore_model(self, model: torch.nn.Module) -> None:
        """Load ``model_state`` into ``model``; clear error on a key or shape mismatch."""
        own = model.state_dict()
        missing = sorted(set(own) - set(self.model_state))
        unexpected = sorted(set(self.model_state) - set(own))
        wrong_shape = sorted(
            k for k in set(own) & set(self.model_state)
            if tuple(own[k].shape) != tuple(self.model_state[k].shape)
        )
        if missing or unexpected or wrong_shape:
            raise CheckpointError(
                "checkpoint model does not fit this model: "
                f"missing {missing}, unexpected {unexpected}, wrong shape {wrong_shape}"
            )
        model.load_state_dict(self.model_state)


def _check_plain(value: Any, where: str) -> None:
    """Reject values ``torch.load(weights_only=True)`` could not restore."""
    if isinstance(value, (*_SCALARS, torch.Tensor)):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise CheckpointError(f"{where}: dict key {key!r} is not str or int")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise CheckpointError(
        f"{where} has type {type(value).__name__}, which a checkpoint cannot hold "
        "(use tensors, numbers, str, bytes, None and lists/tuples/dicts of them; "
        "for numpy use Generator.bit_generator.state, not np.random.get_state())"
    )


def _to_payload(checkpoint: ServerCheckpoint) -> dict[str, Any]:
    return {
        "round": checkpoint.round,
        "version": checkpoint.version,
        "model_state": {k: v.detach().cpu() for k, v in checkpoint.model_state.items()},
        "optimizer_state": checkpoint.optimizer_state,
        "update_log": [(int(v), bytes(b)) for v, b in checkpoint.update_log],
        "config": checkpoint.config,
        "rng_states": checkpoint.rng_states,
        "created_unix": checkpoint.created_unix,
        "strategy_state": checkpoint.strategy_state,
    }


def save_checkpoint(checkpoint: ServerCheckpoint, path: str | Path) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (temp file + fsync + os.replace).

    Parameters
    ----------
    checkpoint : ServerCheckpoint
        What to save; ``created_unix`` is set to now if it is 0.
    path : str or Path
        Target file; its directory is created if missing.

    Returns
    -------
    Path
        The written file.

    Raises
    ------
    CheckpointError
        If the checkpoint holds a value that cannot be stored safely.
    """
    if checkpoint.created_unix == 0.0:
        checkpoint.created_unix = time.time()
    payload = _to_payload(checkpoint)
    _check_plain(payload, "checkpoint")
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    header = _HEADER.pack(_MAGIC, CHECKPOINT_FORMAT_VERSION, len(body),
                          hashlib.sha256(body).digest())

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                    dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(header)
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    # Persist the rename itself.
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def load_checkpoint(path: str | Path) -> ServerCheckpoint:
    """Read and verify a checkpoint written by :func:`save_checkpoint`.

    Raises
    ------
    CheckpointError
        If the file is missing, is not a fedddl checkpoint, has another format
        version, is truncated, fails its checksum or holds malformed content.
    """
    source = Path(path)
    try:
        data = source.read_bytes()
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint {source} does not exist") from err
    if len(data) < _HEADER.size:
        raise CheckpointError(
            f"checkpoint {source} is truncated: {len(data)} bytes, shorter than the "
            f"{_HEADER.size}-byte header"
        )
    magic, fmt, length, digest = _HEADER.unpack_from(data)
    check_magic(
        f"checkpoint {source}",
        magic,
        fmt,
        expected_magic=_MAGIC,
        expected_version=CHECKPOINT_FORMAT_VERSION,
        error=CheckpointError,
    )
    body = data[_HEADER.size:]
    if len(body) != length:
        raise CheckpointError(
            f"checkpoint {source} is truncated or has trailing data: payload is "
            f"{len(body)} bytes, header says {length}"
        )
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"checkpoint {source} is corrupt: checksum mismatch")
    try:
        payload = torch.load(io.BytesIO(body), weights_only=True)
        return ServerCheckpoint(
            round=int(payload["round"]),
            version=int(payload["version"]),
            model_state=dict(payload["model_state"]),
            optimizer_state=dict(payload["optimizer_state"]),
            update_log=[(int(v), bytes(b)) for v, b in payload["update_log"]],
            config=dict(payload["config"]),
            rng_states=payload["rng_states"],
            created_unix=float(payload["created_unix"]),
            strategy_state=dict(payload.get("strategy_state", {})),
        )
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"checkpoint {source} has malformed content: {err}") from err


def checkpoint_path(directory: str | Path, server_round: int) -> Path:
    """The conventional file for ``server_round`` in ``directory``: ``round-000012.ckpt``."""
    if server_round < 0:
        raise ValueError(f"server_round must be >= 0, got {server_round}")
    return Path(directory) / f"round-{server_round:06d}.ckpt"


def _rounds_in(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME_RE.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest ``round-*.ckpt`` in ``directory`` (by round), or None if there is none."""
    rounds = _rounds_in(Path(directory))
    return rounds[-1][1] if rounds else None


def load_latest_checkpoint(
    directory: str | Path, *, skip_corrupt: bool = True
) -> tuple[Path, ServerCheckpoint] | None:
    """Load the newest readable round checkpoint in ``directory``.

    With ``skip_corrupt`` a checkpoint that fails verification is skipped (and
    the next older one tried); otherwise its :class:`CheckpointError` is raised.
    Returns None when there is no (readable) checkpoint.
    """
    for _, path in reversed(_rounds_in(Path(directory))):
        try:
            return path, load_checkpoint(path)
        except CheckpointError:
            if not skip_corrupt:
                raise
    return None


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest round checkpoints; return what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    rounds = _rounds_in(Path(directory))
    doomed = [path for _, path in rounds[:-keep]]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed
