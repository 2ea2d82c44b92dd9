"""Gossip-mode coordinator: membership and metrics only, never model bytes.

``run_gossip(grid, context, config)`` is the ServerApp logic of gossip mode:

1. wait for ``num_nodes`` Flower nodes and give them gossip ids 0..N-1: a node
   whose node config pins one (``gossip-id``, the id its TLS certificate
   names) gets it; the others get the remaining ids in the order of their
   Flower node ids (``hello``);
2. ``start``: every node's handler spawns its peer process and replies with the
   address it serves on;
3. ``peers``: every node gets the full address list; peers start training and
   exchange models with each other over gRPC;
4. ``status`` polls until every peer finished (or exited, or the timeout). A
   node that fails a poll -- its SuperNode is gone (Flower answers with an
   error), or ``lost_after_polls`` polls in a row got no reply within
   ``status_timeout_s`` -- is *lost*: it is recorded in
   :attr:`GossipResult.lost` and no longer waited for, and the others finish
   (their peers back off from the dead peer after a send timeout or two);
5. ``stop``: the remaining peers are stopped (also on error) and their final
   metrics collected.

Every message either way is a few hundred bytes (:attr:`GossipResult.max_message_bytes`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid

from fedddl.gossip.peer_files import format_peers, write_json
from fedddl.gossip.peer_launcher import PEER_OPTIONS
from fedddl.gossip.peer_protocol import (
    MESSAGE_TYPE,
    METRICS_RECORD,
    OP_HELLO,
    OP_PEERS,
    OP_START,
    OP_STATUS,
    OP_STOP,
    REPLY_RECORD,
    REQUEST_RECORD,
)

__all__ = ["GossipConfig", "GossipError", "GossipResult", "run_gossip"]


class GossipError(RuntimeError):
    """A node failed a coordinator request (the message names node and reason)."""


@dataclass(frozen=True)
class GossipConfig:
    """What the coordinator needs; ``peer_options`` go to every peer's command line.

    Attributes
    ----------
    num_nodes : int
        Gossip nodes to use (waits for that many Flower nodes).
    peer_options : Mapping[str, str | int | float]
        Peer options (keys of :data:`fedddl.gossip.peer_launcher.PEER_OPTIONS`).
    run_dir : str
        Base of the nodes' state directories; empty = each node's temp dir.
    node_wait_s, startup_timeout_s, run_timeout_s : float
        Deadlines for nodes to connect, peers to start, training to finish.
    poll_interval_s : float
        Seconds between status polls.
    status_timeout_s : float
        Deadline of one status poll.
    lost_after_polls : int
        Polls in a row without a reply after which a node counts as lost.
    message_timeout_s : float
        Deadline of each round of messages.
    results_path : str
        If set, the :class:`GossipResult` is written there as JSON.
    """

    num_nodes: int
    peer_options: Mapping[str, str | int | float] = field(default_factory=dict)
    run_dir: str = ""
    node_wait_s: float = 60.0
    startup_timeout_s: float = 120.0
    run_timeout_s: float = 600.0
    poll_interval_s: float = 1.0
    status_timeout_s: float = 30.0
    lost_after_polls: int = 3
    message_timeout_s: float = 180.0
    results_path: str = ""

    def __post_init__(self) -> None:
        if self.num_nodes < 2:
            raise ValueError(f"gossip needs num_nodes >= 2, got {self.num_nodes}")
        unknown = sorted(set(self.peer_options) - set(PEER_OPTIONS))
        if unknown:
            raise ValueError(f"unknown peer options {unknown}; allowed: {sorted(PEER_OPTIONS)}")
        for name in (
            "node_wait_s",
            "startup_timeout_s",
            "run_timeout_s",
            "poll_interval_s",
            "status_timeout_s",
            "message_timeout_s",
            "lost_after_polls",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"GossipConfig.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> GossipConfig:
        """Build from a Flower run config: ``gossip-nodes``, ``gossip-run-dir``,
        ``gossip-run-timeout-s``, ``results-path`` and ``gossip-<peer option>``
        (e.g. ``gossip-steps``, ``gossip-scheduler``, ``gossip-tls-dir``,
        ``gossip-insecure``, ``gossip-compressor``)."""
        options = {
            key: run_config[f"gossip-{key}"]
            for key in PEER_OPTIONS
            if f"gossip-{key}" in run_config
        }
        return cls(
            num_nodes=int(run_config.get("gossip-nodes", 0)),
            peer_options=options,
            run_dir=str(run_config.get("gossip-run-dir", "")),
            run_timeout_s=float(run_config.get("gossip-run-timeout-s", 600.0)),
            results_path=str(run_config.get("results-path", "")),
        )


@dataclass
class GossipResult:
    """What the coordinator collected."""

    addresses: dict[int, str]
    flower_node_ids: dict[int, int]
    metrics: dict[int, dict[str, Any]]  # gossip id -> final numbers and fields
    messages: int = 0
    total_message_bytes: int = 0
    max_message_bytes: int = 0
    array_records_seen: int = 0  # model tensors in any coordinator message: must stay 0
    lost: dict[int, str] = field(default_factory=dict)  # gossip id -> why it was given up
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds spent per phase
    wall_s: float = 0.0


class _Channel:
    """Sends one op to many nodes and accounts for every message's size."""

    def __init__(self, grid: Grid, result: GossipResult, config: GossipConfig) -> None:
        self.grid, self.result, self.config = grid, result, config

    def request(
        self, op: str, fields_by_node: Mapping[int, dict[str, Any]], timeout_s: float
    ) -> dict[int, Message]:
        messages = []
        for node_id, fields in fields_by_node.items():
            content = RecordDict({REQUEST_RECORD: ConfigRecord({"op": op, **fields})})
            self._account(content)
            messages.append(
                Message(content=content, dst_node_id=node_id, message_type=MESSAGE_TYPE)
            )
        replies: dict[int, Message] = {}
        for reply in self.grid.send_and_receive(messages, timeout=timeout_s):
            replies[reply.metadata.src_node_id] = reply
            if reply.has_content():
                self._account(reply.content)
        return replies

    def _account(self, content: RecordDict) -> None:
        size = recorddict_to_proto(content).ByteSize()
        self.result.messages += 1
        self.result.total_message_bytes += size
        self.result.max_message_bytes = max(self.result.max_message_bytes, size)
        self.result.array_records_seen += len(content.array_records)


def _fields(reply: Message | None, node: int, op: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if reply is None:
        raise GossipError(f"node {node} sent no reply to {op!r} (timed out)")
    if reply.has_error():
        raise GossipError(f"node {node} failed {op!r}: {reply.error.reason}")
    config = dict(reply.content.config_records[REPLY_RECORD])
    if config.get("status") != "ok":
        raise GossipError(f"node {node} failed {op!r}: {config.get('error')!s}")
    return config, dict(reply.content.metric_records.get(METRICS_RECORD, {}))


def _assign_ids(channel: _Channel, node_ids: list[int]) -> dict[int, int]:
    """Gossip id of each Flower node: its pinned one, else the next free one in order."""
    replies = channel.request(
        OP_HELLO, {f: {} for f in node_ids}, channel.config.message_timeout_s
    )
    pins: dict[int, int] = {}
    for flower_id in node_ids:
        fields, _ = _fields(replies.get(flower_id), flower_id, OP_HELLO)
        pinned = int(fields.get("pinned-id", -1))
        if pinned < 0:
            continue
        if pinned >= len(node_ids) or pinned in pins.values():
            raise GossipError(
                f"Flower node {flower_id} pins gossip id {pinned}, which is out of range "
                f"0..{len(node_ids) - 1} or pinned twice ({pins})"
            )
        pins[flower_id] = pinned
    free = iter(sorted(set(range(len(node_ids))) - set(pins.values())))
    return {f: pins[f] if f in pins else next(free) for f in node_ids}


def _wait_for_nodes(grid: Grid, count: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(node_ids := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise GossipError(f"only {len(node_ids)} of {count} nodes connected in {timeout_s} s")
        time.sleep(0.2)
    return node_ids[:count]


def run_gossip(grid: Grid, context: Context, config: GossipConfig) -> GossipResult:
    """Run one gossip training (see the module docstring); returns the collected metrics.

    Raises
    ------
    GossipError
        If nodes do not connect, a peer cannot start, or a node fails a request.
    """
    began = time.monotonic()
    node_ids = _wait_for_nodes(grid, config.num_nodes, config.node_wait_s)
    result = GossipResult({}, {}, {})
    channel = _Channel(grid, result, config)
    gossip_ids = _assign_ids(channel, node_ids)
    result.flower_node_ids = {g: f for f, g in gossip_ids.items()}

    def per_node(**fields: Any) -> dict[int, dict[str, Any]]:
        base = {"run-dir": config.run_dir} if config.run_dir else {}
        return {f: {**base, "gossip-id": g, **fields} for f, g in gossip_ids.items()}

    def collect(
        op: str, replies: Mapping[int, Message], asked: Mapping[int, object] | None = None
    ) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
        """Checked replies keyed by Flower node id (of all nodes, or those ``asked``)."""
        targets = gossip_ids if asked is None else asked
        return {f: _fields(replies.get(f), gossip_ids[f], op) for f in targets}

    def phase(name: str, since: float) -> float:
        now = time.monotonic()
        result.phase_s[name] = now - since
        return now

    mark = phase("wait_nodes", began)
    try:  # from the first start request on, peers may exist: always stop them
        start_fields = per_node(
            **{"num-nodes": config.num_nodes, "peer-options": json.dumps(dict(config.peer_options))}
        )
        deadline = time.monotonic() + config.startup_timeout_s
        while len(result.addresses) < config.num_nodes:
            # Non-blocking start: every handler spawns its peer at once; ask again until up.
            pending = {
                f: start_fields[f] for f, g in gossip_ids.items() if g not in result.addresses
            }
            replies = channel.request(OP_START, pending, config.message_timeout_s)
            for flower_id, (fields, _) in collect(OP_START, replies, pending).items():
                if fields.get("address"):
                    result.addresses[gossip_ids[flower_id]] = str(fields["address"])
            if len(result.addresses) < config.num_nodes:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(config.num_nodes)) - set(result.addresses))
                    raise GossipError(
                        f"peers {missing} did not start in {config.startup_timeout_s} s"
                    )
                time.sleep(min(config.poll_interval_s, 0.5))
        mark = phase("start_peers", mark)
        log(INFO, "gossip peers up: %s", result.addresses)
        peers = format_peers(result.addresses)
        collect(
            OP_PEERS, channel.request(OP_PEERS, per_node(peers=peers), config.message_timeout_s)
        )
        log(INFO, "gossip training: every peer has its peer list; polling status")
        _poll_until_done(channel, per_node(), gossip_ids, result)
        mark = phase("train", mark)
    finally:
        live = {f: fields for f, fields in per_node().items() if gossip_ids[f] not in result.lost}
        _stop_all(channel, live, gossip_ids, result)
        phase("stop", mark)
    result.wall_s = time.monotonic() - began
    if config.results_path:
        write_json(Path(config.results_path), asdict(result))
    return result


def _stop_all(
    channel: _Channel,
    requests: dict[int, dict[str, Any]],
    gossip_ids: Mapping[int, int],
    result: GossipResult,
) -> None:
    final = channel.request(OP_STOP, requests, channel.config.message_timeout_s)
    for flower_id, gossip_id in gossip_ids.items():
        if flower_id not in requests:
            continue
        try:
            fields, numbers = _fields(final.get(flower_id), gossip_id, OP_STOP)
        except GossipError as exc:  # keep stopping the others
            log(ERROR, "%s", exc)
            continue
        fields["received-from"] = json.loads(str(fields.get("received-from", "{}")))
        fields["rejections"] = json.loads(str(fields.get("rejections", "{}")))
        result.metrics[gossip_id] = {**fields, **numbers}


def _poll_until_done(
    channel: _Channel,
    requests: dict[int, dict[str, Any]],
    gossip_ids: Mapping[int, int],
    result: GossipResult,
) -> None:
    config = channel.config
    deadline = time.monotonic() + config.run_timeout_s
    missed: dict[int, int] = {}
    while True:
        live = {f: r for f, r in requests.items() if gossip_ids[f] not in result.lost}
        replies = channel.request(OP_STATUS, live, config.status_timeout_s)
        statuses: list[dict[str, Any]] = []
        waiting = False  # a node missed this poll but is not lost yet
        for flower_id in live:
            gossip_id = gossip_ids[flower_id]
            reply = replies.get(flower_id)
            try:
                _, numbers = _fields(reply, gossip_id, OP_STATUS)
            except GossipError as exc:
                gone = reply is not None and reply.has_error()  # Flower: node unavailable
                missed[flower_id] = missed.get(flower_id, 0) + 1
                if gone or missed[flower_id] >= config.lost_after_polls:
                    result.lost[gossip_id] = str(exc)
                    log(WARNING, "gossip node %d lost: %s", gossip_id, exc)
                else:
                    waiting = True
                continue
            missed[flower_id] = 0
            statuses.append(numbers)
        done = all(n.get("finished") or n.get("exited") or not n.get("alive") for n in statuses)
        if done and not waiting:
            if len(result.lost) < len(requests):
                return
            raise GossipError("every gossip node was lost")
        if time.monotonic() > deadline:
            log(WARNING, "gossip run timed out after %.0f s; stopping peers",
                config.run_timeout_s)
            return
        time.sleep(config.poll_interval_s)
