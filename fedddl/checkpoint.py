"""Server checkpoints: atomic save and verified load of the ServerApp's state.

A :class:`ServerCheckpoint` holds everything a restarted ServerApp needs to
continue a run where it stopped: the round, the update version, the shadow
replica's ``state_dict``, the optimizer's ``state_dict``, the bounded update
log (``(version, encoded update bytes)`` pairs that lagging clients replay),
the run config, optionally RNG states and further strategy state.

File layout (all integers big-endian)::

    magic      8 bytes  b"FDDLCKPT"
    format     4 bytes  uint32: 1 (CHECKPOINT_FORMAT_VERSION), or 2 (KEYED_FORMAT_VERSION)
    length     8 bytes  uint64, payload length
    digest    32 bytes  format 1: SHA-256 of the payload;
                        format 2: HMAC-SHA256 of magic, format, length and payload
    payload    torch.save of a dict of plain types and tensors

A SHA-256 only detects accidents: anyone can re-hash a crafted file. With a secret key
(``checkpoint-key-file``, :func:`read_key_file`) checkpoints are written in format 2 and
only a file whose HMAC verifies with that key is loaded; a format-1 file is then refused
("not authenticated"), and a format-2 file cannot be loaded without the key. The payload,
and so the MAC, holds the round and the run's identity (``run_id``); a file named
``round-NNNNNN.ckpt`` must hold round NNNNNN, and with a key the directory's high-water
mark (:mod:`fedddl.checkpoint_mark`) refuses a rollback to an older round or another run
(a run's checkpoint directory: :mod:`fedddl.checkpoint_dir`).

Saving writes a temporary file in the target directory, fsyncs it and
``os.replace``-s it over the target (then fsyncs the directory), so a crash
leaves either the old or the new checkpoint, never a torn one. Loading checks
magic, format version, length and checksum before unpickling, and unpickles
with ``torch.load(weights_only=True)`` so a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import re
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedddl.checkpoint_io import CheckpointError, write_atomically
from fedddl.framing import check_magic

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "CHECKPOINT_NAME",
    "KEYED_FORMAT_VERSION",
    "MIN_KEY_BYTES",
    "CheckpointError",
    "ServerCheckpoint",
    "load_checkpoint",
    "read_key_file",
    "save_checkpoint",
    "write_atomically",
]

CHECKPOINT_FORMAT_VERSION = 1
#: Format of a checkpoint authenticated with HMAC-SHA256 (same layout, keyed digest).
KEYED_FORMAT_VERSION = 2
#: Shortest accepted checkpoint key.
MIN_KEY_BYTES = 16
_MAGIC = b"FDDLCKPT"
_HEADER = struct.Struct(">8sIQ32s")
#: The file name of a directory's checkpoint of one round (group 1: the round).
CHECKPOINT_NAME = re.compile(r"^round-(\d{6,})\.ckpt$")

# Types a checkpoint may contain: what torch.load(weights_only=True) restores.
_SCALARS = (type(None), bool, int, float, str, bytes)


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
    run_id : str
        The identity of the run that wrote it (hex; empty when unknown), see
        :mod:`fedddl.checkpoint_mark`.
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
    run_id: str = ""

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

    def check_config(
        self,
        config: Mapping[str, Any],
        keys: Sequence[str],
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """Raise :class:`CheckpointError` if ``config`` differs from the saved one on ``keys``.

        Use it on resume for settings that must not change mid-run
        (dataset, model, strategy, compressor, number of clients, ...). A key missing
        from the saved config (a checkpoint older than the key) counts as its value in
        ``defaults``.
        """
        defaults = defaults or {}
        saved = {key: self.config.get(key, defaults.get(key)) for key in keys}
        differences = [
            f"{key}: checkpoint {saved[key]!r}, run {config.get(key)!r}"
            for key in keys
            if saved[key] != config.get(key)
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
        "run_id": checkpoint.run_id,
    }


def read_key_file(path: str | Path) -> bytes:
    """The checkpoint key in ``path`` (its bytes, surrounding whitespace removed).

    Raises
    ------
    CheckpointError
        If the file cannot be read or the key is shorter than :data:`MIN_KEY_BYTES`.
    """
    try:
        key = Path(path).read_bytes().strip()
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint-key-file {path}: {err}") from err
    _check_key(key, f"checkpoint-key-file {path}")
    return key


def _check_key(key: bytes, what: str = "checkpoint key") -> None:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise CheckpointError(f"{what} must hold at least {MIN_KEY_BYTES} bytes")


def _digest(fmt: int, body: bytes, key: bytes | None) -> bytes:
    if key is None:
        return hashlib.sha256(body).digest()
    mac = hmac.new(key, _MAGIC + struct.pack(">IQ", fmt, len(body)), hashlib.sha256)
    mac.update(body)
    return mac.digest()


def save_checkpoint(
    checkpoint: ServerCheckpoint, path: str | Path, *, key: bytes | None = None
) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (temp file + fsync + os.replace).

    Parameters
    ----------
    checkpoint : ServerCheckpoint
        What to save; ``created_unix`` is set to now if it is 0.
    path : str or Path
        Target file; its directory is created if missing.
    key : bytes | None
        Authenticate the file with HMAC-SHA256 under this key (format 2).

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
    if key is not None:
        _check_key(key)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    fmt = CHECKPOINT_FORMAT_VERSION if key is None else KEYED_FORMAT_VERSION
    header = _HEADER.pack(_MAGIC, fmt, len(body), _digest(fmt, body, key))
    target = Path(path)
    write_atomically(target, [header, body])
    return target


def load_checkpoint(path: str | Path, *, key: bytes | None = None) -> ServerCheckpoint:
    """Read and verify a checkpoint written by :func:`save_checkpoint`.

    With ``key``, only a file authenticated with that key (format 2) is accepted. A file
    named ``round-NNNNNN.ckpt`` must hold round NNNNNN.

    Raises
    ------
    CheckpointError
        If the file is missing, is not a fedddl checkpoint, has another format
        version, is truncated, fails its checksum or authentication, holds malformed
        content, or another round than its name says.
    """
    if key is not None:
        _check_key(key)
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
        expected_version=fmt if fmt == KEYED_FORMAT_VERSION else CHECKPOINT_FORMAT_VERSION,
        error=CheckpointError,
    )
    if fmt == KEYED_FORMAT_VERSION and key is None:
        raise CheckpointError(
            f"checkpoint {source} is authenticated with a key (format version {fmt}, "
            "HMAC-SHA256): set checkpoint-key-file to load it"
        )
    if fmt == CHECKPOINT_FORMAT_VERSION and key is not None:
        raise CheckpointError(
            f"checkpoint {source} is not authenticated (format version {fmt}, plain "
            "SHA-256) but a checkpoint key is configured"
        )
    body = data[_HEADER.size:]
    if len(body) != length:
        raise CheckpointError(
            f"checkpoint {source} is truncated or has trailing data: payload is "
            f"{len(body)} bytes, header says {length}"
        )
    if not hmac.compare_digest(_digest(fmt, body, key), digest):
        if key is not None:
            raise CheckpointError(
                f"checkpoint {source} fails authentication: HMAC mismatch (corrupt, "
                "crafted, or written with another key)"
            )
        raise CheckpointError(f"checkpoint {source} is corrupt: checksum mismatch")
    try:
        payload = torch.load(io.BytesIO(body), weights_only=True)
        checkpoint = ServerCheckpoint(
            round=int(payload["round"]),
            version=int(payload["version"]),
            model_state=dict(payload["model_state"]),
            optimizer_state=dict(payload["optimizer_state"]),
            update_log=[(int(v), bytes(b)) for v, b in payload["update_log"]],
            config=dict(payload["config"]),
            rng_states=payload["rng_states"],
            created_unix=float(payload["created_unix"]),
            strategy_state=dict(payload.get("strategy_state", {})),
            run_id=str(payload.get("run_id", "")),
        )
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"checkpoint {source} has malformed content: {err}") from err
    named = CHECKPOINT_NAME.match(source.name)
    if named and int(named.group(1)) != checkpoint.round:
        raise CheckpointError(
            f"checkpoint {source} holds round {checkpoint.round}, its name says round "
            f"{int(named.group(1))} (renamed or copied over a newer checkpoint?)"
        )
    return checkpoint
