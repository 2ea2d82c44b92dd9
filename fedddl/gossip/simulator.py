"""Discrete-event simulator of gossip SGD with real training under a virtual clock.

Every node trains a real model on its own shard (real SGD steps, real test accuracy);
only time is simulated, by a heap of ``step``, ``recv_start`` / ``arrive`` and ``eval``
events ordered by virtual time (ties in insertion order). Transfers take their times
from :class:`fedddl.network.LinkScheduler`; with ``compressor`` set a message is a
compressed difference (:mod:`fedddl.gossip.compressed`, as on the real peers) and
sizes, estimates and ``bytes_total`` use the encoded size; with the ``scheduled``
scheduler the status broadcasts count in ``bytes_total`` too. The events in detail:
docs/gossip.md.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedddl.gossip.admission import RejectionLog
from fedddl.gossip.attack import poison_state
from fedddl.gossip.clip import MergeClip, clip_level, difference
from fedddl.gossip.compressed import CompressedGossip, OutgoingUpdate
from fedddl.gossip.estimator import CommTimeEstimator
from fedddl.gossip.scheduler import PeerState, Scheduler, get_scheduler
from fedddl.gossip.sim_config import GossipConfig
from fedddl.gossip.sim_setup import SimSetup, build_setup
from fedddl.gossip.sim_status import StatusBoard
from fedddl.network import LinkScheduler, NetworkModel, Transfer, load_network
from fedddl.progress import report
from fedddl.seeding import derive_seed
from fedddl.training import evaluate

__all__ = ["GossipSimulation", "run_gossip"]

ProgressFn = Callable[[str], None]


@dataclass
class _Message:
    transfer: Transfer
    state: dict[str, torch.Tensor] | None  # the model (uncompressed gossip)
    version: int
    update: OutgoingUpdate | None = None  # the compressed difference (compressed gossip)


class GossipSimulation:
    """One run; :meth:`run` returns the result dict (see :func:`run_gossip`)."""

    def __init__(
        self,
        config: GossipConfig,
        setup: SimSetup,
        network: NetworkModel,
        progress: ProgressFn | None = None,
    ) -> None:
        self.config = config
        self.setup = setup
        self.nodes = setup.nodes
        self.network = network
        self.progress = progress
        self.links = LinkScheduler(
            network, downlink_holds_latency=config.downlink_holds_latency
        )
        kwargs = (
            {"stale_threshold_steps": config.stale_threshold_steps, "selection": config.selection}
            if config.scheduler == "scheduled"
            else {}
        )
        self.scheduler: Scheduler = get_scheduler(config.scheduler, **kwargs)
        self.shares_status = config.scheduler == "scheduled"
        n = len(self.nodes)
        self.estimators = [CommTimeEstimator(alpha=config.estimator_alpha) for _ in range(n)]
        self.rngs = [np.random.default_rng([config.seed, i, 1]) for i in range(n)]
        self.board = StatusBoard(network)
        self.receiving = [0] * n  # transfers in progress into each node
        self._queue: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.messages = 0
        self.stale_merges = 0
        self.merges = 0
        self.merge_lags: list[int] = []  # receiver clock - received clock, per merge
        self.deferred = 0
        self.model_bytes_total = 0
        self.compressed: list[CompressedGossip] = []
        if config.compressor:
            self.compressed = [
                CompressedGossip(
                    config.compressor, setup.initial_state,
                    seed=derive_seed(config.seed, i, 0xC0),
                    consensus_step=config.consensus_step,
                    scale_bucket=config.scale_bucket,
                )
                for i in range(n)
            ]
        self.attackers = set(range(n - config.attackers, n)) if config.attack else set()
        self.honest = [i for i in range(n) if i not in self.attackers]
        self.clips: list[MergeClip] = []
        if config.clip > 0:
            self.clips = [MergeClip(config.clip, setup.initial_state) for _ in range(n)]
        self.clip_logs = [RejectionLog(f"node {i}", action="clipped") for i in range(n)]
        self.curve: list[list[float]] = []
        self.time_to_target: float | None = None

    # ---------------------------------------------------------------- events
    def _push(self, time_s: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self._queue, (time_s, next(self._seq), kind, data))

    def _message_bytes(self, node: int) -> int:
        """Size of ``node``'s next model message, as the scheduler and estimates see it."""
        if self.compressed:
            return self.compressed[node].expected_bytes()
        return self.setup.model_bytes

    def _state(self, node: int, time_s: float) -> PeerState:
        sim_node = self.nodes[node]
        est = self.estimators[node]
        model_bytes = self._message_bytes(node)
        shared = {
            p: est.estimate(p, model_bytes) for p in range(len(self.nodes)) if est.observed(p)
        }
        speed = sim_node.steps / time_s if time_s > 0 else 1.0 / sim_node.step_time_s
        return PeerState(node, self.receiving[node] == 0, sim_node.version, shared, speed)

    def _publish(self, node: int, time_s: float) -> None:
        if self.shares_status:
            self.board.publish(self._state(node, time_s), time_s)

    def _peers(self, me: int, time_s: float) -> dict[int, PeerState]:
        if self.shares_status:
            peers = self.board.view(me, time_s)
        else:  # classic gossip uses no shared state
            peers = {i: PeerState(i, True, 0) for i in range(len(self.nodes))}
        peers[me] = self._state(me, time_s)
        return peers

    def _on_step(self, node: int, now: float) -> None:
        sim_node = self.nodes[node]
        sim_node.sgd_step()
        next_start = now
        wants_send = sim_node.steps % self.config.exchange_every == 0
        overlap = self.config.overlaps
        if wants_send and (not overlap or not self.links.uplink_busy(node, now)):
            peer = self.scheduler.choose_peer(
                node, self._peers(node, now), self._message_bytes(node),
                self.estimators[node], self.rngs[node],
            )
            if peer is None:
                self.deferred += 1
            else:
                message = self._send(node, peer, now)
                self._push(message.transfer.start_s, "recv_start", message)
                self._push(message.transfer.end_s, "arrive", message)
                if not overlap:
                    return  # the next step is scheduled on delivery
        self._push(next_start + sim_node.step_time_s, "step", node)

    def _outgoing(self, node: int) -> dict[str, torch.Tensor]:
        """What ``node`` sends: its model, or a compromised node's poison."""
        state = self.nodes[node].snapshot()
        if node in self.attackers:
            cfg = self.config
            return poison_state(cfg.attack, state, self.setup.initial_state, cfg.attack_scale)
        return state

    def _send(self, node: int, peer: int, now: float) -> _Message:
        sim_node = self.nodes[node]
        if self.compressed:
            update = self.compressed[node].prepare(peer, self._outgoing(node))
            # The simulated network delivers everything: the link advances now, the
            # sender's consensus step comes when the message arrives (its "ack").
            self.compressed[node].commit(update)
            size = len(update.payload) + update.header.extra_bytes
            transfer = self.links.reserve(node, peer, size, now)
            return _Message(transfer, None, sim_node.version, update)
        transfer = self.links.reserve(node, peer, self.setup.model_bytes, now)
        return _Message(transfer, self._outgoing(node), sim_node.version)

    def _on_recv_start(self, message: _Message, now: float) -> None:
        dst = message.transfer.dst
        self.receiving[dst] += 1
        if self.receiving[dst] == 1:
            self._publish(dst, now)

    def _on_arrive(self, message: _Message, now: float) -> None:
        transfer = message.transfer
        receiver = self.nodes[transfer.dst]
        lag = receiver.version - message.version
        self.merge_lags.append(lag)
        if lag > self.config.stale_threshold_steps:
            self.stale_merges += 1
        src, dst = transfer.src, transfer.dst
        if message.update is None:
            assert message.state is not None
            received = self._clipped_model(dst, src, message.state)
            receiver.merge(received, message.version, self.config.merge_weight)
        else:  # compressed: one CHOCO edge update on both ends
            update = message.update
            correction = self.compressed[dst].receive(src, update.header, update.payload)
            receiver.correct(self._clipped(dst, src, correction), message.version)
            sender_correction = self.compressed[src].sender_correction(dst)
            self.nodes[src].correct(self._clipped(src, dst, sender_correction), None)
        self.merges += 1
        self.messages += 1
        self.model_bytes_total += transfer.num_bytes
        self.estimators[transfer.src].observe(transfer.dst, transfer.num_bytes, transfer.duration_s)
        self.receiving[transfer.dst] -= 1
        if self.receiving[transfer.dst] == 0:
            self._publish(transfer.dst, now)
        if not self.config.overlaps:
            sender = self.nodes[transfer.src]
            self._push(now + sender.step_time_s, "step", transfer.src)

    def _clipped_model(
        self, node: int, peer: int, received: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``received``, or ``own + clip(received - own)`` when the clip cuts it."""
        if not self.clips:
            return received
        own = self.nodes[node].model.state_dict()
        outcome = self.clips[node].clip(peer, difference(received, own), own)
        if outcome.reason is None:
            return received
        self._count_clip(node, peer, outcome.reason, outcome.norm, outcome.bound)
        return {k: (own[k] + outcome.update[k]) if k in outcome.update else v
                for k, v in received.items()}

    def _clipped(
        self, node: int, peer: int, correction: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A compressed edge update (``step * difference``), clipped at ``node``."""
        if not self.clips:
            return correction
        own = self.nodes[node].model.state_dict()
        outcome = self.clips[node].clip(peer, correction, own, self.config.consensus_step)
        if outcome.reason is None:
            return correction
        self._count_clip(node, peer, outcome.reason, outcome.norm, outcome.bound)
        return outcome.update

    def _count_clip(self, node: int, peer: int, reason: str, norm: float, bound: float) -> None:
        self.clip_logs[node].record(
            f"node {peer}", reason, "CLIPPED",
            f"difference norm {norm:.4g} clipped to {bound:.4g}", clip_level(reason),
        )

    def _clip_counts(self) -> dict[str, dict[str, int]]:
        """``{"node j": {reason: frames}}`` summed over the receivers."""
        total: dict[str, dict[str, int]] = {}
        for log in self.clip_logs:
            for peer, reasons in log.by_peer().items():
                into = total.setdefault(peer, {})
                for reason, count in reasons.items():
                    into[reason] = into.get(reason, 0) + count
        return dict(sorted(total.items()))

    def _on_eval(self, now: float) -> bool:
        accs = [
            evaluate(self.nodes[i].model, self.setup.x_test, self.setup.y_test)[1]
            for i in self.honest
        ]
        mean = float(np.mean(accs))
        self.curve.append([now, mean])
        reached = self.time_to_target is None and mean >= self.config.target_accuracy
        if reached:
            self.time_to_target = now
        report(
            self.progress,
            f"[gossip {self.config.scheduler}/{self.network.name}] t={now:8.2f}s"
            f" acc={mean:.4f} steps={sum(n.steps for n in self.nodes)}"
            f" msgs={self.messages} stale={self.stale_merges}",
            done=now,
        )
        return reached and self.config.stop_at_target

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Simulate until ``max_virtual_time_s``; returns the result dict."""
        wall_start = time.perf_counter()
        cfg = self.config
        for i, node in enumerate(self.nodes):
            self._publish(i, 0.0)
            self._push(node.step_time_s, "step", i)
        num_evals = int(np.floor(cfg.max_virtual_time_s / cfg.eval_interval_s + 1e-9))
        eval_times = [k * cfg.eval_interval_s for k in range(num_evals + 1)]
        if eval_times[-1] < cfg.max_virtual_time_s - 1e-9:
            eval_times.append(cfg.max_virtual_time_s)
        for t in eval_times:
            self._push(t, "eval")
        now = 0.0
        while self._queue:
            now, _, kind, data = heapq.heappop(self._queue)
            if now > cfg.max_virtual_time_s:
                break
            if kind == "step":
                self._on_step(data, now)
            elif kind == "recv_start":
                self._on_recv_start(data, now)
            elif kind == "arrive":
                self._on_arrive(data, now)
            elif self._on_eval(now):
                break
        model_bytes = self.setup.model_bytes
        model_total = self.model_bytes_total
        return {
            "config": cfg.to_dict(),
            "curve": self.curve,
            "time_to_target_s": self.time_to_target,
            "bytes_total": model_total + self.board.bytes,
            "messages": self.messages,
            "stale_merges": self.stale_merges,
            "final_accuracy": self.curve[-1][1],
            "model_bytes": model_bytes,
            "model_bytes_total": model_total,
            "message_bytes_mean": model_total / self.messages if self.messages else None,
            "compressor": cfg.compressor or None,
            "key_frames": sum(c.sender.key_frames for c in self.compressed),
            "status_messages": self.board.messages,
            "status_bytes_total": self.board.bytes,
            "merges": self.merges,
            "merge_lag_mean": float(np.mean(self.merge_lags)) if self.merge_lags else None,
            "merge_lag_max": max(self.merge_lags, default=None),
            "deferred_sends": self.deferred,
            "steps_total": sum(n.steps for n in self.nodes),
            "steps_per_node": [n.steps for n in self.nodes],
            "step_time_s": [n.step_time_s for n in self.nodes],
            "network": self.network.name,
            "overlap": cfg.overlaps,
            "clipped": self._clip_counts(),
            "attackers": sorted(self.attackers),
            "wall_time_s": time.perf_counter() - wall_start,
        }


def run_gossip(
    config: GossipConfig | Mapping[str, Any], *, progress: ProgressFn | None = None
) -> dict[str, Any]:
    """Run one simulation and return its result.

    Parameters
    ----------
    config
        A :class:`GossipConfig` or a mapping of its fields.
    progress
        Called with one line per evaluation (e.g. ``print`` to stderr); ``None`` = silent.
        A :class:`fedddl.progress.Progress` also moves its bar to the virtual time.

    Returns
    -------
    dict
        ``config``, ``curve`` (``[[virtual_time_s, mean_test_accuracy], ...]``),
        ``time_to_target_s`` (``None`` if never reached), ``bytes_total``,
        ``messages``, ``stale_merges``, ``final_accuracy`` (honest nodes only when
        some are compromised), ``clipped`` (``{"node j": {reason: frames}}``, summed
        over receivers), ``attackers``, and details (``model_bytes``,
        ``status_bytes_total``, ``steps_total``, ``wall_time_s``, ...).
    """
    cfg = config if isinstance(config, GossipConfig) else GossipConfig.from_mapping(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: threads cost more than they give
    try:
        network = load_network(cfg.network, cfg.nodes, seed=cfg.seed)
        setup = build_setup(cfg)
        if len(setup.nodes) != network.num_nodes:
            raise ValueError(f"{len(setup.nodes)} nodes but a {network.num_nodes}-node network")
        return GossipSimulation(cfg, setup, network, progress).run()
    finally:
        torch.set_num_threads(threads)


def stderr_progress(line: str) -> None:
    """Progress callback writing to stderr."""
    print(line, file=sys.stderr, flush=True)
