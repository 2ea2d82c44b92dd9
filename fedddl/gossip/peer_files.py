"""Files through which a long-lived gossip peer process is found and steered.

One *state directory* per node (e.g. ``<run dir>/node-<id>``) holds:

``node.json``
    Written by the peer once it serves: ``{"pid", "node_id", "port", "address"}``.
``peers.json``
    Written by whoever manages membership (the Flower client handler, a test):
    ``{"peers": {"<node id>": "host:port", ...}}``. The peer waits for it
    before it starts training when it was not given ``--peers``.
``metrics.json``
    Written by the peer every ``metrics_interval_s``, at exit and on SIGTERM.
``spawn.lock``
    Created exclusively by the process that spawns the peer, so it is spawned once.

Writes are atomic (temporary file + rename), so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedddl.proc import pid_alive

__all__ = [
    "METRICS_FILE",
    "NODE_FILE",
    "PEERS_FILE",
    "SPAWN_LOCK",
    "claim_spawn",
    "format_peers",
    "parse_peers",
    "pid_alive",
    "read_json",
    "read_peers",
    "wait_for_json",
    "write_json",
    "write_peers",
]

NODE_FILE = "node.json"
PEERS_FILE = "peers.json"
METRICS_FILE = "metrics.json"
SPAWN_LOCK = "spawn.lock"


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write ``obj`` as JSON to ``path`` (creating parent folders)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, target)


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """Return the JSON content of ``path``, or ``None`` when it does not exist yet."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def wait_for_json(path: str | os.PathLike[str], timeout_s: float, poll_s: float = 0.05) -> Any:
    """Wait until ``path`` exists and return its content.

    Raises
    ------
    TimeoutError
        If it does not appear within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        content = read_json(path)
        if content is not None:
            return content
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.1f} s")
        time.sleep(poll_s)


def parse_peers(spec: str) -> dict[int, str]:
    """Parse ``"ID=HOST:PORT,..."`` into ``{id: "host:port"}``.

    Raises
    ------
    ValueError
        Naming the bad entry.
    """
    peers: dict[int, str] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, address = entry.partition("=")
        host, colon, port = address.rpartition(":")
        if not sep or not colon or not host or not port.isdigit() or not key.strip().isdigit():
            raise ValueError(f"bad peer entry {entry!r}: expected ID=HOST:PORT")
        if int(key) in peers:
            raise ValueError(f"peer {int(key)} listed twice")
        peers[int(key)] = address
    return peers


def format_peers(peers: Mapping[int, str]) -> str:
    """Inverse of :func:`parse_peers`."""
    return ",".join(f"{node}={address}" for node, address in sorted(peers.items()))


def write_peers(state_dir: str | os.PathLike[str], peers: Mapping[int, str]) -> None:
    """Tell the peer in ``state_dir`` its peer list."""
    parse_peers(format_peers(peers))  # validates every address
    write_json(Path(state_dir) / PEERS_FILE, {"peers": {str(k): v for k, v in peers.items()}})


def read_peers(path: str | os.PathLike[str]) -> dict[int, str] | None:
    """Read a ``peers.json``; ``None`` if absent.

    Raises
    ------
    ValueError
        If the file does not hold a valid peer list.
    """
    content = read_json(path)
    if content is None:
        return None
    if not isinstance(content, dict) or not isinstance(content.get("peers"), dict):
        raise ValueError(f"{path}: expected {{'peers': {{id: address}}}}")
    return parse_peers(format_peers({int(k): str(v) for k, v in content["peers"].items()}))


def claim_spawn(state_dir: str | os.PathLike[str]) -> bool:
    """Atomically claim the right to spawn the peer of ``state_dir``; True for the winner."""
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(Path(state_dir) / SPAWN_LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with contextlib.closing(os.fdopen(fd, "w")) as handle:
        handle.write(str(os.getpid()))
    return True


