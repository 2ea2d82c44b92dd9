"""Checkpoint file primitives shared by the checkpoints and the high-water mark: the error
type and atomic writes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CheckpointError", "write_atomically"]


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or incompatible."""


def write_atomically(target: Path, chunks: Sequence[bytes]) -> None:
    """Write ``chunks`` to ``target`` through a temporary file in its directory (created if
    missing), fsync-ed and renamed over it, then fsync the directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                    dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
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
