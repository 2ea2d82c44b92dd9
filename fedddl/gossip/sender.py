"""The sending half of a gossip node: choose a scheduled peer, ship it the model, back off.

A :class:`Sender` ships a snapshot of its node's model (a MODEL frame, or a compressed
DELTA frame) to the partner the scheduler picks, within the peers' model-frame rate; a
peer that does not answer is backed off by how the send failed
(:mod:`fedddl.gossip.peer_backoff`). Its state loop broadcasts the node's
:class:`~fedddl.gossip.scheduler.PeerState` whenever it changes, and at least every
second. It works on the node's :class:`~fedddl.gossip.shared_state.SharedState` under its
locks and asks the node for its model through :class:`SenderHooks`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedddl.gossip.admission import Admission, RejectedFrame, RejectionLog
from fedddl.gossip.compressed import CompressedGossip, float_tensors
from fedddl.gossip.estimator import CommTimeEstimator
from fedddl.gossip.node_config import NodeConfig
from fedddl.gossip.peer_backoff import PeerBackoff, failure_kind
from fedddl.gossip.scheduler import PeerState, Scheduler
from fedddl.gossip.shared_state import SharedState
from fedddl.gossip.transport import TransportError
from fedddl.gossip.wire import FrameKind, decode_frame, encode_frame

__all__ = ["STATE_REFRESH_S", "Sender", "SenderHooks", "first_frame_bytes"]

_log = logging.getLogger(__name__)
#: The state is re-broadcast at least this often (versions, speed), changed or not.
STATE_REFRESH_S = 1.0

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SenderHooks:
    """What a sender asks of its node's model; the node takes its own locks in each.

    ``own_state``: the node's shareable state. ``version``: its clock now.
    ``snapshot``: its version and a copy of the model to send. ``clipped``: an edge update
    with a peer (``step * difference``), clipped as the node clips received ones.
    """

    own_state: Callable[[], PeerState]
    version: Callable[[], int]
    snapshot: Callable[[], tuple[int, Tensors]]
    clipped: Callable[[int, Tensors], Tensors]


def first_frame_bytes(
    node_id: int, gossip: CompressedGossip | None, state: Mapping[str, torch.Tensor]
) -> int:
    """Size of a model frame before the first one is sent (the scheduler needs one)."""
    own = PeerState(node_id, True, 0)
    if gossip is not None:
        return len(encode_frame(FrameKind.STATE, node_id, own)) + gossip.expected_bytes()
    return len(encode_frame(FrameKind.MODEL, node_id, own, state))


class Sender:
    """Ships a node's model to scheduled peers and broadcasts its state.

    Parameters
    ----------
    config : NodeConfig
        The node's settings (id, seed, timeouts, frame limit, peers' rate limit).
    shared : SharedState
        What the node's receiving half shares with this sender.
    hooks : SenderHooks
        The node's model, as the sender needs it.
    scheduler : Scheduler
        Chooses the partner of each send.
    estimator : CommTimeEstimator
        Transfer-time estimator; it learns from acknowledged model frames.
    admission : Admission
        Checks the clock a peer's reply carries.
    rejection_log : RejectionLog
        Counts replies whose clock was ignored.
    """

    def __init__(
        self,
        config: NodeConfig,
        shared: SharedState,
        hooks: SenderHooks,
        scheduler: Scheduler,
        estimator: CommTimeEstimator,
        admission: Admission,
        rejection_log: RejectionLog,
    ) -> None:
        self.config = config
        self.shared = shared
        self.hooks = hooks
        self.scheduler = scheduler
        self.estimator = estimator
        self.admission = admission
        self.rejection_log = rejection_log
        self._backoff = PeerBackoff(config.limits.max_model_rate)
        self._last_model_send: dict[int, float] = {}
        self._rng = np.random.default_rng([config.seed, config.node_id])

    @property
    def node_id(self) -> int:
        """The sending node's id."""
        return self.config.node_id

    def send_loop(self) -> None:
        """Ship every new version of the model until the node stops or finishes training."""
        shared = self.shared
        last_sent = -1
        while not shared.stop.is_set() and not shared.done.is_set():
            if self.hooks.version() == last_sent:
                shared.stop.wait(0.002)
                continue
            sent = self.ship_snapshot()
            if sent is None:
                shared.stop.wait(0.005)
            elif sent >= 0:
                last_sent = sent

    def ship_snapshot(self) -> int | None:
        """Send a snapshot of the model (or its compressed difference) to a scheduled peer.

        Returns its version if it was delivered, -1 if the send failed, None if no
        peer could be chosen.
        """
        with self.shared.state_lock:
            size = self.shared.frame_bytes
        peer = self._choose_peer(size)
        if peer is None:
            return None
        version, snapshot = self.hooks.snapshot()
        return version if self._ship(peer, snapshot) else -1

    def _ship(self, peer: int, snapshot: Tensors) -> bool:
        """Send ``snapshot`` (or its compressed difference) to ``peer``; True if acked."""
        shared = self.shared
        update = None
        if shared.gossip is None:
            frame = encode_frame(FrameKind.MODEL, self.node_id, self.hooks.own_state(), snapshot)
        else:
            with shared.links_lock:
                update = shared.gossip.prepare(peer, float_tensors(snapshot))
            frame = encode_frame(
                FrameKind.DELTA, self.node_id, self.hooks.own_state(),
                link=update.header, update=update.payload,
            )
        with shared.state_lock:
            self._last_model_send[peer] = time.monotonic()
        if not self._send(peer, frame, is_model=True):
            return False
        with shared.state_lock:
            if update is None or not update.header.key:
                shared.frame_bytes = len(frame)  # what the scheduler plans with next
            counters = shared.counters
            counters.sent_to[peer] = counters.sent_to.get(peer, 0) + 1
            counters.model_bytes_sent += len(frame)
            if update is not None and update.header.key:
                counters.key_frames_sent += 1
        if update is not None:
            assert shared.gossip is not None
            with shared.links_lock:
                correction = shared.gossip.commit(update)
            correction = self.hooks.clipped(peer, correction)
            with shared.state_lock:
                shared.inbox.add_correction(correction, None)
        return True

    def _choose_peer(self, frame_bytes: int) -> int | None:
        shared = self.shared
        now = time.monotonic()
        with shared.state_lock:
            states = {
                p: s for p, s in shared.peer_states.items() if self._backoff.choosable(p, now)
            }
        if not states:
            return None
        states[self.node_id] = self.hooks.own_state()
        peer = self.scheduler.choose_peer(
            self.node_id, states, frame_bytes, self.estimator, self._rng
        )
        if peer is not None:  # stay within the peers' rate limit: wait for its next slot
            with shared.state_lock:
                last = self._last_model_send.get(peer, -math.inf)
            wait = last + 1.0 / self.config.limits.max_model_rate - time.monotonic()
            if wait > 0 and shared.stop.wait(wait):
                return None
        return peer

    def _send(self, peer: int, frame: bytes, is_model: bool = False) -> bool:
        shared = self.shared
        with shared.state_lock:
            client = shared.clients[peer]
        try:
            result = client.send(frame, self.config.send_timeout_s)
            reply = decode_frame(result.reply, self.config.max_frame_bytes)
            if reply.sender != peer or reply.kind is not FrameKind.ACK:
                raise ValueError(f"peer {peer} answered with a {reply.kind.name} of {reply.sender}")
        except (TransportError, ValueError) as exc:
            self._on_send_failure(peer, exc)
            return False
        with shared.state_lock:
            shared.counters.bytes_sent += len(frame)
            if is_model:  # the estimator models model messages; STATE pings would skew it
                self.estimator.observe(peer, len(frame), result.seconds)
                shared.counters.count_transfer(peer, result.seconds)
            self._backoff.succeeded(peer)
        try:  # a reply's clock feeds the scheduler only: a wild one is ignored
            self.admission.check_version(peer, reply.state.model_version, self.hooks.version())
        except RejectedFrame as exc:
            self.rejection_log.record(f"node {peer}", exc.key, "IGNORED_REPLY", exc.reason)
            return True
        with shared.state_lock:
            shared.peer_states[peer] = reply.state
        return True

    def _on_send_failure(self, peer: int, exc: Exception) -> None:
        shared = self.shared
        kind = failure_kind(exc)
        with shared.state_lock:
            backoff = self._backoff.failed(peer, kind, time.monotonic())
            if kind == "rate-limited":
                shared.counters.rate_limited += 1
            elif kind == "out-of-sync":
                shared.counters.links_reset += 1
            elif kind == "failed":
                shared.counters.send_failures += 1
                state = shared.peer_states.get(peer)
                if state is not None:
                    shared.peer_states[peer] = PeerState(
                        peer, False, state.model_version, state.est_comm_time_s,
                        state.steps_per_s,
                    )
        if kind == "out-of-sync" and shared.gossip is not None:
            with shared.links_lock:
                shared.gossip.reset(peer)  # a key frame next time
        if kind == "failed":
            _log.info("node %d: %s; backing off %.2f s", self.node_id, exc, backoff)

    def state_loop(self) -> None:
        """Broadcast the node's state when it changes (and every ``STATE_REFRESH_S``) until
        the node stops; the last broadcast after training ended says "disabled"."""
        shared = self.shared
        last_enabled: bool | None = None
        last_sent = 0.0
        while not shared.stop.wait(self.config.state_interval_s):
            state = self.hooks.own_state()
            stale = time.monotonic() - last_sent > STATE_REFRESH_S
            if state.enabled == last_enabled and not stale and not shared.done.is_set():
                continue
            last_enabled, last_sent = state.enabled, time.monotonic()
            frame = encode_frame(FrameKind.STATE, self.node_id, state)
            now = time.monotonic()
            with shared.state_lock:
                targets = [p for p in shared.clients if self._backoff.ready(p, now)]
            for peer in targets:
                if shared.stop.is_set():
                    return
                self._send(peer, frame)
            if shared.done.is_set():
                return  # the final "disabled" broadcast went out
