"""The high-water mark of a checkpoint directory: which run writes there, and the newest
round it has saved, authenticated with the checkpoint key.

With a key (``checkpoint-key-file``) the ServerApp rewrites the mark after every checkpoint
it saves, and the loader (:func:`fedddl.checkpoint_dir.load_latest_checkpoint`) refuses to
resume from a round older than the mark's, or from a checkpoint of another run: an older
authentic file renamed to a newer name, or the newest files deleted, is then a refused
rollback rather than a silent one. The run identity is a random id drawn when a run first
saves into a directory without a mark; every checkpoint it writes holds it under the MAC.

File layout (``high-water.mark``, integers big-endian)::

    magic    8 bytes   b"FDDLMARK"
    format   4 bytes   uint32: 1
    round    8 bytes   uint64: the newest round saved
    run id  16 bytes   the run's identity
    tag     32 bytes   HMAC-SHA256 of the preceding bytes under the checkpoint key

What the mark cannot see: a mark and checkpoints replaced together by older authentic
copies of both (a full-directory rollback), and anything at all without a key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

from fedddl.checkpoint_io import CheckpointError, write_atomically

__all__ = ["MARK_NAME", "HighWaterMark", "new_run_id", "read_mark", "write_mark"]

#: The mark's file name in a checkpoint directory.
MARK_NAME = "high-water.mark"
_MAGIC = b"FDDLMARK"
_FORMAT = 1
_BODY = struct.Struct(">8sIQ16s")
_TAG_BYTES = 32


@dataclass(frozen=True)
class HighWaterMark:
    """A run's identity (hex, 32 digits) and the newest round it saved."""

    run_id: str
    round: int


def new_run_id() -> str:
    """A fresh random run identity (hex, 32 digits)."""
    return secrets.token_hex(16)


def _tag(body: bytes, key: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def write_mark(directory: str | Path, mark: HighWaterMark, key: bytes) -> Path:
    """Write ``mark`` into ``directory`` atomically, authenticated with ``key``."""
    body = _BODY.pack(_MAGIC, _FORMAT, mark.round, bytes.fromhex(mark.run_id))
    target = Path(directory) / MARK_NAME
    write_atomically(target, [body, _tag(body, key)])
    return target


def read_mark(directory: str | Path, key: bytes) -> HighWaterMark | None:
    """The mark in ``directory``, or None if there is none.

    Raises
    ------
    CheckpointError
        If the mark is unreadable, malformed or fails authentication with ``key``.
    """
    path = Path(directory) / MARK_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"cannot read the high-water mark {path}: {err}") from err
    if len(data) != _BODY.size + _TAG_BYTES:
        raise CheckpointError(f"high-water mark {path} has {len(data)} bytes, not a mark")
    body, tag = data[: _BODY.size], data[_BODY.size :]
    magic, fmt, round_, run_id = _BODY.unpack(body)
    if magic != _MAGIC or fmt != _FORMAT:
        raise CheckpointError(f"high-water mark {path} has a wrong magic or format")
    if not hmac.compare_digest(_tag(body, key), tag):
        raise CheckpointError(
            f"high-water mark {path} fails authentication: HMAC mismatch (corrupt, crafted, "
            "or written with another key)"
        )
    return HighWaterMark(run_id.hex(), int(round_))
