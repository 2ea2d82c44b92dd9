"""Start, find, query and stop the long-lived peer process of one node.

Used by the Flower client handler, whose process may live for one message
only: everything it needs to find the peer again is in the node's state
directory (:mod:`fedddl.gossip.peer_files`), and the peer runs in its own
session so it outlives the process that spawned it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedddl.gossip.peer_files import (
    METRICS_FILE,
    NODE_FILE,
    claim_spawn,
    pid_alive,
    read_json,
    write_json,
)

__all__ = [
    "PEER_OPTIONS",
    "PeerLaunchError",
    "ensure_peer",
    "peer_cli_args",
    "peer_metrics",
    "stop_peer",
]

SPAWNED_FILE = "spawned.json"
LOG_FILE = "peer.log"

# Options a remote coordinator may set, with their types; anything else is refused
# so a message can never inject other command-line arguments. ``bool`` options are
# flags (given when true); an empty string means "not set".
PEER_OPTIONS: dict[str, type] = {
    "tls-dir": str,
    "insecure": bool,
    "compressor": str,
    "consensus-step": float,
    "max-model-rate": float,
    "model-burst": int,
    "max-version-jump": int,
    "max-abs-weight": float,
    "clip": float,
    "steps": int,
    "batch-size": int,
    "learning-rate": float,
    "scheduler": str,
    "merge": str,
    "eval-every": int,
    "eval-samples": int,
    "min-step-s": float,
    "send-timeout-s": float,
    "shaper": str,
    "dataset": str,
    "data-root": str,
    "partition": str,
    "arch": str,
    "seed": int,
    "max-frame-bytes": int,
    "linger-s": float,
    "peers-timeout-s": float,
    "max-lifetime-s": float,
    "log-level": str,
}


class PeerLaunchError(RuntimeError):
    """The peer process could not be started or found."""


def peer_cli_args(
    node_id: int, num_nodes: int, bind: str, advertise: str, options: Mapping[str, object]
) -> list[str]:
    """Build the peer's command line from whitelisted, type-checked ``options``.

    Raises
    ------
    ValueError
        Naming an unknown option or a value of the wrong type.
    """
    args = ["--node-id", str(node_id), "--num-nodes", str(num_nodes), "--bind", bind]
    if advertise:
        args += ["--advertise", advertise]
    for key, value in sorted(options.items()):
        kind = PEER_OPTIONS.get(key)
        if kind is None:
            raise ValueError(f"unknown peer option {key!r}; allowed: {sorted(PEER_OPTIONS)}")
        if kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"peer option {key!r} must be bool, got {value!r}")
            if value:
                args.append(f"--{key}")
            continue
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"peer option {key!r} must be {kind.__name__}, got {value!r}")
        if value == "":
            continue
        args += [f"--{key}", str(value)]
    return args


def ensure_peer(
    state_dir: str | os.PathLike[str], cli_args: Sequence[str], timeout_s: float = 120.0
) -> dict[str, Any] | None:
    """Return the running peer's ``node.json``, spawning the peer once if needed.

    With ``timeout_s=0`` it does not wait: ``None`` means "spawned, still starting"
    (ask again), so one caller can start many peers in parallel.

    Raises
    ------
    PeerLaunchError
        If the peer exited already, dies while starting, or does not come up in time.
    """
    state = Path(state_dir)
    info = read_json(state / NODE_FILE)
    if info is not None:
        if pid_alive(int(info["pid"])):
            return dict(info)
        raise PeerLaunchError(f"the peer of {state} already ran and exited (pid {info['pid']})")
    if claim_spawn(state):
        with (state / LOG_FILE).open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fedddl.gossip.peer", *cli_args, "--state-dir", str(state)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # survives the (short-lived) spawning process
            )
        write_json(state / SPAWNED_FILE, {"pid": proc.pid})
    deadline = time.monotonic() + timeout_s
    while (info := read_json(state / NODE_FILE)) is None:
        spawned = read_json(state / SPAWNED_FILE)
        if spawned is not None and not pid_alive(int(spawned["pid"])):
            raise PeerLaunchError(f"the peer of {state} died while starting:\n{_log_tail(state)}")
        if timeout_s == 0:
            return None
        if time.monotonic() > deadline:
            raise PeerLaunchError(f"the peer of {state} did not start within {timeout_s} s")
        time.sleep(0.05)
    return dict(info)


def peer_metrics(state_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Latest metrics of the peer (``{}`` before the first write), with ``alive`` added."""
    state = Path(state_dir)
    metrics = read_json(state / METRICS_FILE)
    info = read_json(state / NODE_FILE)
    result: dict[str, Any] = dict(metrics) if isinstance(metrics, dict) else {}
    result["alive"] = info is not None and pid_alive(int(info["pid"]))
    return result


def stop_peer(state_dir: str | os.PathLike[str], timeout_s: float = 10.0) -> dict[str, Any]:
    """SIGTERM the peer, wait for its final metrics, SIGKILL it if it does not exit.

    Returns
    -------
    dict
        Its last metrics (see :func:`peer_metrics`).
    """
    state = Path(state_dir)
    pids = [
        int(content["pid"])
        for content in (read_json(state / NODE_FILE), read_json(state / SPAWNED_FILE))
        if isinstance(content, dict)
    ]
    for pid in set(pids):
        if pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        if peer_metrics(state).get("exited"):  # final metrics are written: only teardown left
            deadline = min(deadline, time.monotonic() + 1.0)
        time.sleep(0.05)
    for pid in set(pids):
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # its own session: pgid == pid
    return peer_metrics(state)


def _log_tail(state: Path) -> str:
    try:
        return (state / LOG_FILE).read_text(errors="replace")[-2000:]
    except FileNotFoundError:
        return "(no log)"
