"""Flower ClientApp handler for gossip mode: each node's bridge to its peer process.

Register it on a ClientApp for ``query.gossip`` messages::

    app = ClientApp()
    app.query("gossip")(handle_gossip)

Under default isolation every message runs in a fresh process, so the handler
keeps no state: it spawns the node's long-lived peer (``python -m
fedddl.gossip.peer``) on ``start`` and finds it again through the node's state
directory on every later message. Model exchange is peer to peer; replies only
carry status and a few numbers.

Node config keys (``--node-config`` of a SuperNode, all optional):

``gossip-bind``
    ``host:port`` the peer serves on; default ``127.0.0.1:0`` (any free port).
``gossip-advertise``
    ``host:port`` other nodes reach it at (needed across machines).
``gossip-state-dir``
    Where its files live; default ``<run dir>/node-<gossip id>`` with the run
    dir from the coordinator or ``$TMPDIR/fedddl-gossip/run-<run id>``.
``gossip-tls-dir``
    This machine's TLS folder for the peer (``ca.crt`` and ``node-<id>.pem`` /
    ``.key``); it replaces the run config's ``gossip-tls-dir`` and
    ``gossip-insecure``, so each machine needs only its own node's key.
``gossip-id``
    The gossip id this node must get (the one its certificate names); the
    coordinator asks for it (``hello``) before it hands out ids.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedddl.gossip.peer_files import parse_peers, write_peers
from fedddl.gossip.peer_launcher import (
    PeerLaunchError,
    ensure_peer,
    peer_cli_args,
    peer_metrics,
    stop_peer,
)
from fedddl.gossip.peer_protocol import (
    METRICS_RECORD,
    NUMERIC_METRICS,
    OP_HELLO,
    OP_PEERS,
    OP_START,
    OP_STOP,
    OPS,
    REPLY_RECORD,
    REQUEST_RECORD,
)

__all__ = ["handle_gossip", "node_state_dir"]


def handle_gossip(msg: Message, context: Context) -> Message:
    """Answer one coordinator request (``start``/``peers``/``status``/``stop``).

    Errors (bad request, peer that cannot start) are reported in the reply's
    ``status``/``error`` fields rather than raised, so the coordinator can name
    the node and the reason.
    """
    try:
        request = msg.content.config_records[REQUEST_RECORD]
    except KeyError:
        return _reply(msg, {"status": "error", "error": f"no {REQUEST_RECORD!r} config record"})
    op = request.get("op")
    try:
        if op not in OPS:
            raise ValueError(f"unknown gossip op {op!r}; expected one of {OPS}")
        if op == OP_HELLO:
            pinned = context.node_config.get("gossip-id", -1)
            if isinstance(pinned, bool) or not isinstance(pinned, int) or pinned < -1:
                raise ValueError(f"node config gossip-id must be an int >= 0, got {pinned!r}")
            return _reply(msg, {"status": "ok", "pinned-id": pinned})
        gossip_id = _int(request, "gossip-id")
        state_dir = node_state_dir(context, str(request.get("run-dir", "")), gossip_id)
        if op == OP_START:
            info = _start(request, context, gossip_id, state_dir)
            if info is None:  # spawned, not serving yet: the coordinator asks again
                return _reply(msg, {"status": "ok", "address": "", "state-dir": str(state_dir)})
            return _reply(msg, {"status": "ok", "address": str(info["address"]),
                                "pid": int(info["pid"]), "state-dir": str(state_dir)})
        if op == OP_PEERS:
            write_peers(state_dir, parse_peers(str(request.get("peers", ""))))
            return _reply(msg, {"status": "ok"})
        metrics = stop_peer(state_dir) if op == OP_STOP else peer_metrics(state_dir)
        return _reply(msg, {"status": "ok"}, metrics)
    except (ValueError, PeerLaunchError, OSError, TimeoutError) as exc:
        return _reply(msg, {"status": "error", "error": f"{type(exc).__name__}: {exc}"})


def node_state_dir(context: Context, run_dir: str, gossip_id: int) -> Path:
    """State directory of this node's peer (see the module docstring)."""
    configured = context.node_config.get("gossip-state-dir")
    if configured:
        return Path(str(configured))
    base = Path(run_dir) if run_dir else (
        Path(tempfile.gettempdir()) / "fedddl-gossip" / f"run-{context.run_id}"
    )
    return base / f"node-{gossip_id}"


def _start(
    request: ConfigRecord, context: Context, gossip_id: int, state_dir: Path
) -> dict[str, Any] | None:
    options = json.loads(str(request.get("peer-options", "{}")))
    if not isinstance(options, dict):
        raise ValueError("peer-options must be a JSON object")
    tls_dir = context.node_config.get("gossip-tls-dir")
    if tls_dir:  # this machine's own TLS folder
        options = {**options, "tls-dir": str(tls_dir), "insecure": False}
    args = peer_cli_args(
        gossip_id,
        _int(request, "num-nodes"),
        str(context.node_config.get("gossip-bind", "127.0.0.1:0")),
        str(context.node_config.get("gossip-advertise", "")),
        options,
    )
    wait_s = request.get("wait-s", 0.0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s < 0:
        raise ValueError(f"request field 'wait-s' must be a number >= 0, got {wait_s!r}")
    return ensure_peer(state_dir, args, float(wait_s))


def _int(request: ConfigRecord, key: str) -> int:
    value = request.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"request field {key!r} must be an int >= 0, got {value!r}")
    return value


def _reply(msg: Message, fields: dict[str, Any], metrics: dict[str, Any] | None = None) -> Message:
    content = RecordDict()
    reply = dict(fields)
    numbers: dict[str, int | float | list[int] | list[float]] = {}
    if metrics is not None:
        for key in NUMERIC_METRICS:
            value = metrics.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numbers[key] = value
        numbers["finished"] = int(bool(metrics.get("finished")))
        numbers["exited"] = int(bool(metrics.get("exited")))
        numbers["alive"] = int(bool(metrics.get("alive")))
        numbers["secure"] = int(bool(metrics.get("secure")))
        reply["received-from"] = json.dumps(metrics.get("received_from", {}), sort_keys=True)
        reply["rejections"] = json.dumps(metrics.get("rejections", {}), sort_keys=True)
        reply["compressor"] = str(metrics.get("compressor") or "")
        reply["exit-reason"] = str(metrics.get("exit_reason"))
        reply["address"] = str(metrics.get("address", ""))
    content[REPLY_RECORD] = ConfigRecord(reply)
    content[METRICS_RECORD] = MetricRecord(numbers)
    return Message(content, reply_to=msg)
