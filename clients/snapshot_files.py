"""Client replica snapshots in files shared by the processes of one machine.

Flower ships a node's whole ``context.state`` to the simulation actor and back with every
message, so a replica snapshot there (weights, BatchNorm buffers, momentum) slows every
message (``docs/round-time.md``). With a snapshot directory (``client-snapshot-dir``; ``fedddl
simulate`` uses a temporary one per run), :func:`clients.state.save_state` writes the
snapshot to a file and ``context.state`` keeps only its name and checksum
(:data:`FILE_KEYS`), the digests and the journal.

Files are named by the version and the history digest (``v<version>-<digest>.snap``), so
clients whose replicas are the same state share one file, written once (atomically: a
temporary file renamed). A file is read back only if its BLAKE2b checksum matches the one in
the client's records; a missing, altered or pruned file is no error: the client has no
replica and asks the server for a snapshot (the protocol's resync). Files more than
:data:`KEEP_VERSIONS` versions older than the newest written are deleted. Every process of
the run must see the same directory (one machine); across machines, keep the snapshots in
``context.state`` (the default outside ``fedddl simulate``).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["FILE_KEYS", "KEEP_VERSIONS", "read_snapshot", "write_snapshot"]

#: The ``fedddl.meta`` entries naming a client's snapshot file.
FILE_KEYS = ("snapshot-file", "snapshot-sum")
#: Versions a snapshot file is kept after a newer one was written.
KEEP_VERSIONS = 32
_NAME = re.compile(r"v(\d{12})-[0-9a-f]{32}\.snap")


def _checksum(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def write_snapshot(
    directory: Path, version: int, digest: str, data: bytes | memoryview
) -> dict[str, str]:
    """Write the packed snapshot ``data`` of a replica at ``version`` with history
    ``digest`` (unless that file exists); return the meta entries naming it."""
    name = f"v{version:012d}-{digest}.snap"
    if not _NAME.fullmatch(name):
        raise ValueError(f"bad snapshot file name {name!r}")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    checksum = _checksum(data)
    if not path.exists():
        handle, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _prune(directory, version)
    return {"snapshot-file": name, "snapshot-sum": checksum}


def read_snapshot(directory: Path, meta: Mapping[str, object]) -> bytes | None:
    """The snapshot bytes named in ``meta``, or None if the file is missing or altered."""
    name, checksum = (meta.get(k) for k in FILE_KEYS)
    if not isinstance(name, str) or not isinstance(checksum, str) or not _NAME.fullmatch(name):
        return None
    try:
        data = (directory / name).read_bytes()
    except OSError:
        return None
    return data if _checksum(data) == checksum else None


def _prune(directory: Path, newest: int) -> None:
    """Delete snapshot files more than :data:`KEEP_VERSIONS` versions older than ``newest``."""
    for path in directory.glob("v*.snap"):
        match = _NAME.fullmatch(path.name)
        if match and int(match.group(1)) < newest - KEEP_VERSIONS:
            path.unlink(missing_ok=True)
