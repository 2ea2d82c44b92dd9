"""One real gossip node: trains, serves model exchanges, ships models to scheduled peers.

A :class:`PeerNode` runs a training thread (merges what arrived, then steps; never waits
on the network unless ``overlap=False``), a sender thread (ships a snapshot, a MODEL
frame or a compressed DELTA frame, to the partner its ``Scheduler`` picks) and a state
thread (broadcasts its :class:`~fedddl.gossip.scheduler.PeerState`).
:meth:`PeerNode.handle_frame` checks a frame completely (format, the caller's
certificate, membership, rate, clock, every tensor) before it can touch the model; a
refused frame gets an error status and is counted per peer and reason. What a
neighbour's model may change in the node's own is clipped (:mod:`fedddl.gossip.clip`);
clipped frames are counted per peer and reason too. Frames that
arrive before training starts are held (at most ``hold_limit``) and admitted once the
peer list is known. A peer that does not answer within ``send_timeout_s`` is backed off
exponentially and treated as disabled. Behaviour in detail: docs/gossip.md.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np
import torch

from fedddl.gossip.admission import Admission, RejectedFrame, RejectionLog
from fedddl.gossip.attack import poison_state
from fedddl.gossip.clip import MergeClip, clip_level, difference
from fedddl.gossip.compressed import CompressedGossip, LinkError, add_correction, float_tensors
from fedddl.gossip.estimator import CommTimeEstimator
from fedddl.gossip.frame_checks import check_frame
from fedddl.gossip.held_frames import NOT_READY, HeldFrames
from fedddl.gossip.inbox import Inbox
from fedddl.gossip.merge import merge_models, version_weight
from fedddl.gossip.node_config import NodeConfig, TrainingData
from fedddl.gossip.node_metrics import NodeCounters, counter_metrics
from fedddl.gossip.peer_backoff import FINISHED, PeerBackoff, failure_kind
from fedddl.gossip.scheduler import PeerState, get_scheduler
from fedddl.gossip.tls import PeerTls, require_loopback
from fedddl.gossip.transport import LinkShaper, PeerClient, PeerServer, TransportError
from fedddl.gossip.wire import Frame, FrameKind, decode_frame, encode_frame
from fedddl.seeding import derive_seed
from fedddl.training import (
    compute_gradients,
    evaluate,
    iterate_minibatches,
    parameters_fingerprint,
)

__all__ = ["NOT_READY", "NodeConfig", "PeerNode", "TrainingData"]

_log = logging.getLogger(__name__)
_STATE_REFRESH_S = 1.0  # re-broadcast the state at least this often (versions, speed)


class PeerNode:
    """A gossip node serving on gRPC and training in background threads.

    Parameters
    ----------
    config : NodeConfig
        Node settings.
    model : torch.nn.Module
        The local model (all nodes of a run start from the same seed).
    data : TrainingData
        Shard and test set.
    bind : str
        ``host:port`` to serve on; port 0 picks a free one.
    shaper : LinkShaper, optional
        Artificial per-peer link delays.
    estimator : CommTimeEstimator, optional
        Transfer-time estimator (a default one if omitted).
    tls : PeerTls, optional
        Mutual TLS (this node's certificate). Without it the node is insecure and
        only serves and dials loopback addresses.

    Raises
    ------
    ValueError
        Without ``tls``, if ``bind`` is not a loopback address.
    """

    def __init__(
        self,
        config: NodeConfig,
        model: torch.nn.Module,
        data: TrainingData,
        bind: str = "127.0.0.1:0",
        shaper: LinkShaper | None = None,
        estimator: CommTimeEstimator | None = None,
        tls: PeerTls | None = None,
    ) -> None:
        if tls is None:
            require_loopback(bind, "bind address")
        elif tls.node_id != config.node_id:
            raise ValueError(f"TLS material of node {tls.node_id} given to node {config.node_id}")
        self.config = config
        self.model = model
        self.data = data
        self.tls = tls
        self.shaper = shaper or LinkShaper()
        self.estimator = estimator or CommTimeEstimator()
        self.scheduler = get_scheduler(config.scheduler)
        self._optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
        state = model.state_dict()
        self._spec = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        self._model_lock = threading.Lock()  # model, version
        self._state_lock = threading.Lock()  # pending, peer states, counters, clients
        self._links_lock = threading.Lock()  # compressed gossip's public copies
        self._gossip: CompressedGossip | None = None
        if config.compressor:
            self._gossip = CompressedGossip(
                config.compressor,
                state,
                seed=derive_seed(config.seed, config.node_id, 0xC0),
                consensus_step=config.consensus_step,
                scale_bucket=config.scale_bucket,
                max_abs_weight=config.limits.max_abs_weight,
            )
        self.admission = Admission(config.limits)
        self.rejection_log = RejectionLog(f"node {config.node_id}")
        self.clip_log = RejectionLog(f"node {config.node_id}", action="clipped")
        self._initial = {k: v.detach().clone() for k, v in state.items()}
        self.clip = MergeClip(config.clip, state) if config.clip > 0 else None
        self._version = 0
        self._step = 0
        self._steps_per_s = 0.0
        self._ship_wait_s = 0.0  # training time spent waiting for sends (overlap=False)
        self._inbox = Inbox()  # received since the last merge
        self._held = HeldFrames(config.hold_limit)
        self._receiving = 0  # frames being handled right now: our "downlink" is busy
        self._peer_states: dict[int, PeerState] = {}
        self._clients: dict[int, PeerClient] = {}
        self._backoff = PeerBackoff(config.limits.max_model_rate)
        self._last_model_send: dict[int, float] = {}
        self._counters = NodeCounters()
        self._accuracy: list[dict[str, float]] = []
        self._rng = np.random.default_rng([config.seed, config.node_id])
        self._frame_bytes = self._initial_frame_bytes(state)
        self._started_at = time.time()
        self._finished_at: float | None = None
        self.error: str | None = None  # why training stopped early, if it crashed
        self._training = threading.Event()
        self._done = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.server = PeerServer(
            self.handle_frame, bind, config.max_frame_bytes, tls=tls, rejections=self.rejection_log
        )

    def _initial_frame_bytes(self, state: Mapping[str, torch.Tensor]) -> int:
        """Size of a model frame, before the first one is sent (the scheduler needs one)."""
        base = len(encode_frame(FrameKind.STATE, self.node_id, PeerState(self.node_id, True, 0)))
        if self._gossip is not None:
            return base + self._gossip.expected_bytes()
        return len(encode_frame(FrameKind.MODEL, self.node_id, PeerState(self.node_id, True, 0),
                                state))

    # ------------------------------------------------------------------ lifecycle
    @property
    def node_id(self) -> int:
        """This node's id."""
        return self.config.node_id

    @property
    def secure(self) -> bool:
        """Whether the node talks mutual TLS."""
        return self.tls is not None

    def serve(self) -> None:
        """Start the gRPC service (frames are held until training starts)."""
        self.server.start()

    def set_peers(self, peers: Mapping[int, str]) -> None:
        """Set the other nodes' addresses (its own id is ignored).

        Raises
        ------
        ValueError
            On an insecure node, if an address is not on loopback.
        """
        if self.tls is None:
            for node, address in peers.items():
                if node != self.node_id:
                    require_loopback(address, f"address of peer {node}")
        with self._state_lock:
            for node, address in peers.items():
                if node == self.node_id or node in self._clients:
                    continue
                self._clients[node] = PeerClient(node, address, self.shaper, self.tls)
                self._peer_states[node] = PeerState(node, True, 0)

    def start_training(self, run_threads: bool = True) -> None:
        """Admit the held frames and run the training, sender and state threads.

        With ``run_threads=False`` the node only accepts frames; the caller merges
        them with :meth:`merge_pending` (tests, embedding in another loop).
        """
        with self._state_lock:
            if self._training.is_set():
                raise RuntimeError("training already started")
            self._started_at = time.time()
            self._training.set()
            held = self._held.take()
        for frame, num_bytes in held:
            try:
                self._admit(frame, num_bytes)
            except RejectedFrame as exc:
                with self._state_lock:
                    self._counters.held_dropped += 1
                self.rejection_log.record(
                    f"node {frame.sender}", exc.key, exc.code.name, f"held frame: {exc.reason}"
                )
        if not run_threads:
            return
        loops = [(self._train_loop, "train"), (self._state_loop, "state")]
        if self.config.overlap:
            loops.append((self._send_loop, "sender"))
        for target, name in loops:
            thread = threading.Thread(target=target, name=f"node{self.node_id}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Wait until training finished (or was stopped); True if it did."""
        return self._done.wait(timeout_s)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop all threads and the service; safe to call twice."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.config.send_timeout_s + grace_s)
        self.server.stop(grace_s)
        with self._state_lock:
            clients = list(self._clients.values())
        for client in clients:
            client.close()

    # ------------------------------------------------------------------ receiving
    def handle_frame(self, data: bytes, caller: int | None = None) -> bytes:
        """Check one incoming frame, queue what it brings, reply with an ACK.

        Parameters
        ----------
        data : bytes
            The frame.
        caller : int, optional
            Node id of the caller's verified certificate (``None`` without TLS).

        Raises
        ------
        WireError
            Malformed, truncated, oversized or corrupted frame.
        RejectedFrame
            Any other refusal (see the module docstring).
        """
        with self._state_lock:
            self._receiving += 1
        try:
            frame = self._check(data, caller)
            if not self._hold(frame, len(data)):
                self._admit(frame, len(data))
        finally:
            with self._state_lock:
                self._receiving -= 1
        return encode_frame(FrameKind.ACK, self.node_id, self.own_state())

    def _check(self, data: bytes, caller: int | None) -> Frame:
        """Checks that need no peer list: format, identity, model shape."""
        frame = decode_frame(data, self.config.max_frame_bytes)
        check_frame(frame, self.node_id, caller, self.secure, self._gossip is not None, self._spec)
        return frame

    def _hold(self, frame: Frame, num_bytes: int) -> bool:
        """Hold a frame that arrives before training starts; False once it has started."""
        with self._state_lock:
            if self._training.is_set():
                return False
            self._held.hold(frame, num_bytes)
            self._counters.held += 1
        return True

    def _admit(self, frame: Frame, num_bytes: int) -> None:
        """Checks against the peer list and the limits; then queue the frame's content."""
        sender = frame.sender
        with self._state_lock:
            known = sender in self._clients
        if not known:
            raise RejectedFrame(
                grpc.StatusCode.PERMISSION_DENIED,
                f"sender {sender} is not a known peer",
                "unknown-sender",
                sender,
            )
        version = frame.state.model_version
        if frame.kind.carries_model:
            if self._done.is_set():
                raise RejectedFrame(grpc.StatusCode.UNAVAILABLE, FINISHED, "finished", sender)
            self.admission.take_model_slot(sender)
        self.admission.check_version(sender, version, self._version)
        correction: dict[str, torch.Tensor] | None = None
        if frame.kind is FrameKind.MODEL:
            self.admission.check_weights(sender, frame.tensors)
        elif frame.kind is FrameKind.DELTA:
            correction = self._clipped(sender, self._receive_delta(frame))
        self.admission.accept_version(version)
        with self._state_lock:
            self._peer_states[sender] = frame.state
            self._counters.bytes_received += num_bytes
            if frame.kind is FrameKind.MODEL:
                self._inbox.add_model(sender, frame.tensors, version)
            elif correction is not None:
                self._inbox.add_correction(correction, version)
            if frame.kind.carries_model:
                received = self._counters.received_from
                received[sender] = received.get(sender, 0) + 1

    def _receive_delta(self, frame: Frame) -> dict[str, torch.Tensor]:
        assert self._gossip is not None and frame.link is not None
        try:
            with self._links_lock:
                return self._gossip.receive(frame.sender, frame.link, frame.update)
        except LinkError as exc:
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if exc.key == "link-out-of-sync"
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            raise RejectedFrame(code, str(exc), exc.key, frame.sender) from None

    def _own_for_clip(self) -> dict[str, torch.Tensor] | None:
        """A copy of the model when the clip's warm-up bound needs it, else ``None``."""
        if self.clip is None or not self.clip.warming_up:
            return None
        with self._model_lock:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _clipped(
        self, peer: int, correction: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A compressed edge update (``step * difference`` with ``peer``), clipped."""
        if self.clip is None:
            return correction
        outcome = self.clip.clip(
            peer, correction, self._own_for_clip(), self.config.consensus_step
        )
        if outcome.reason is None:
            return correction
        self._count_clip(peer, outcome.reason, outcome.norm, outcome.bound)
        return outcome.update

    def _count_clip(self, peer: int, reason: str, norm: float, bound: float) -> None:
        self.clip_log.record(
            f"node {peer}", reason, "CLIPPED",
            f"difference norm {norm:.4g} clipped to {bound:.4g}", clip_level(reason),
        )

    # ------------------------------------------------------------------ state
    def own_state(self) -> PeerState:
        """This node's shareable state: enabled = training and not receiving a frame right now."""
        with self._state_lock:
            enabled = self._training.is_set() and not self._done.is_set() and not self._receiving
            size = self._frame_bytes
            estimates = {p: self.estimator.estimate(p, size) for p in self._clients}
        return PeerState(self.node_id, enabled, self._version, estimates, self._steps_per_s)

    def fingerprint(self) -> str:
        """SHA-256 of the model's parameters and buffers."""
        with self._model_lock:
            return parameters_fingerprint(self.model)

    # ------------------------------------------------------------------ training
    def _train_loop(self) -> None:
        cfg = self.config
        generator = torch.Generator().manual_seed(cfg.seed * 1000 + cfg.node_id)
        batches = iterate_minibatches(
            self.data.x_train, self.data.y_train, cfg.batch_size, generator
        )
        self._record_accuracy()
        began = time.perf_counter()
        try:
            while self._step < cfg.steps and not self._stop.is_set():
                step_start = time.perf_counter()
                x, y = next(batches)
                with self._model_lock:
                    # Average in what arrived since the last step, then step on the merged
                    # model (as the simulator does: merge on arrival, the next step starts
                    # from the merged model). Stepping first and merging after would halve
                    # every step followed by a merge (weight 0.5).
                    self._merge_pending_locked()
                    compute_gradients(self.model, x, y)
                    self._optimizer.step()
                    self._version += 1
                self._step += 1
                if self._step % cfg.eval_every == 0 or self._step == cfg.steps:
                    self._record_accuracy()
                spare = cfg.min_step_s - (time.perf_counter() - step_start)
                if spare > 0:
                    self._stop.wait(spare)
                if not cfg.overlap:
                    ship_start = time.perf_counter()
                    self._ship_snapshot()
                    self._ship_wait_s += time.perf_counter() - ship_start
                self._steps_per_s = self._step / max(time.perf_counter() - began, 1e-9)
        except Exception as exc:
            self.error = f"training failed: {exc!r}"
            _log.exception("node %d: training failed", self.node_id)
        finally:
            self._finished_at = time.time()
            self._done.set()

    def merge_pending(self) -> int:
        """Merge what was received since the last merge; returns how many updates."""
        with self._model_lock:
            return self._merge_pending_locked()

    def _merge_pending_locked(self) -> int:
        with self._state_lock:
            received = self._inbox.take()
        if not received.models and received.correction is None:
            return 0
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for sender, (tensors, version) in received.models.items():
            if self.clip is not None:
                outcome = self.clip.clip(sender, difference(tensors, state), state)
                if outcome.reason is not None:
                    self._count_clip(sender, outcome.reason, outcome.norm, outcome.bound)
                    tensors = {
                        k: (state[k] + outcome.update[k]) if k in outcome.update else v
                        for k, v in tensors.items()
                    }
            weight = 0.5 if self.config.merge == "average" else version_weight(
                self._version, version
            )
            state = merge_models(state, tensors, weight)
            self._version = max(self._version, version)  # Lamport clock over SGD steps
        if received.correction is not None:  # compressed gossip: the summed edge updates
            state = add_correction(state, received.correction)
            self._version = max(self._version, received.correction_version)
        self.model.load_state_dict(state)
        merged = len(received)
        with self._state_lock:
            self._counters.merged += merged
        return merged

    def _record_accuracy(self) -> None:
        with self._model_lock:
            _, accuracy = evaluate(self.model, self.data.x_test, self.data.y_test)
        self._accuracy.append(
            {"step": self._step, "t": time.time() - self._started_at, "accuracy": accuracy}
        )

    # ------------------------------------------------------------------ sending
    def _send_loop(self) -> None:
        last_sent = -1
        while not self._stop.is_set() and not self._done.is_set():
            if self._version == last_sent:
                self._stop.wait(0.002)
                continue
            sent = self._ship_snapshot()
            if sent is None:
                self._stop.wait(0.005)
            elif sent >= 0:
                last_sent = sent

    def _ship_snapshot(self) -> int | None:
        """Send a snapshot of the model (or its compressed difference) to a scheduled peer.

        Returns its version if it was delivered, -1 if the send failed, None if no
        peer could be chosen.
        """
        with self._state_lock:
            size = self._frame_bytes
        peer = self._choose_peer(size)
        if peer is None:
            return None
        with self._model_lock:
            version = self._version
            snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.config.attack:
            snapshot = poison_state(
                self.config.attack, snapshot, self._initial, self.config.attack_scale
            )
        return version if self._ship(peer, snapshot) else -1

    def _ship(self, peer: int, snapshot: dict[str, torch.Tensor]) -> bool:
        """Send ``snapshot`` (or its compressed difference) to ``peer``; True if acked."""
        update = None
        if self._gossip is None:
            frame = encode_frame(FrameKind.MODEL, self.node_id, self.own_state(), snapshot)
        else:
            with self._links_lock:
                update = self._gossip.prepare(peer, float_tensors(snapshot))
            frame = encode_frame(
                FrameKind.DELTA, self.node_id, self.own_state(),
                link=update.header, update=update.payload,
            )
        with self._state_lock:
            self._last_model_send[peer] = time.monotonic()
        if not self._send(peer, frame, is_model=True):
            return False
        with self._state_lock:
            if update is None or not update.header.key:
                self._frame_bytes = len(frame)  # what the scheduler plans with next
            self._counters.sent_to[peer] = self._counters.sent_to.get(peer, 0) + 1
            self._counters.model_bytes_sent += len(frame)
            if update is not None and update.header.key:
                self._counters.key_frames_sent += 1
        if update is not None:
            assert self._gossip is not None
            with self._links_lock:
                correction = self._gossip.commit(update)
            correction = self._clipped(peer, correction)
            with self._state_lock:
                self._inbox.add_correction(correction, None)
        return True

    def _choose_peer(self, frame_bytes: int) -> int | None:
        now = time.monotonic()
        with self._state_lock:
            states = {
                p: s for p, s in self._peer_states.items() if self._backoff.choosable(p, now)
            }
        if not states:
            return None
        states[self.node_id] = self.own_state()
        peer = self.scheduler.choose_peer(
            self.node_id, states, frame_bytes, self.estimator, self._rng
        )
        if peer is not None:  # stay within the peers' rate limit: wait for its next slot
            with self._state_lock:
                last = self._last_model_send.get(peer, -math.inf)
            wait = last + 1.0 / self.config.limits.max_model_rate - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return None
        return peer

    def _send(self, peer: int, frame: bytes, is_model: bool = False) -> bool:
        with self._state_lock:
            client = self._clients[peer]
        try:
            result = client.send(frame, self.config.send_timeout_s)
            reply = decode_frame(result.reply, self.config.max_frame_bytes)
            if reply.sender != peer or reply.kind is not FrameKind.ACK:
                raise ValueError(f"peer {peer} answered with a {reply.kind.name} of {reply.sender}")
        except (TransportError, ValueError) as exc:
            self._on_send_failure(peer, exc)
            return False
        with self._state_lock:
            self._counters.bytes_sent += len(frame)
            if is_model:  # the estimator models model messages; STATE pings would skew it
                self.estimator.observe(peer, len(frame), result.seconds)
                self._counters.count_transfer(peer, result.seconds)
            self._backoff.succeeded(peer)
        try:  # a reply's clock feeds the scheduler only: a wild one is ignored
            self.admission.check_version(peer, reply.state.model_version, self._version)
        except RejectedFrame as exc:
            self.rejection_log.record(f"node {peer}", exc.key, "IGNORED_REPLY", exc.reason)
            return True
        with self._state_lock:
            self._peer_states[peer] = reply.state
        return True

    def _on_send_failure(self, peer: int, exc: Exception) -> None:
        kind = failure_kind(exc)
        with self._state_lock:
            backoff = self._backoff.failed(peer, kind, time.monotonic())
            if kind == "rate-limited":
                self._counters.rate_limited += 1
            elif kind == "out-of-sync":
                self._counters.links_reset += 1
            elif kind == "failed":
                self._counters.send_failures += 1
                state = self._peer_states.get(peer)
                if state is not None:
                    self._peer_states[peer] = PeerState(
                        peer, False, state.model_version, state.est_comm_time_s,
                        state.steps_per_s,
                    )
        if kind == "out-of-sync" and self._gossip is not None:
            with self._links_lock:
                self._gossip.reset(peer)  # a key frame next time
        if kind == "failed":
            _log.info("node %d: %s; backing off %.2f s", self.node_id, exc, backoff)

    def _state_loop(self) -> None:
        last_enabled: bool | None = None
        last_sent = 0.0
        while not self._stop.wait(self.config.state_interval_s):
            state = self.own_state()
            stale = time.monotonic() - last_sent > _STATE_REFRESH_S
            if state.enabled == last_enabled and not stale and not self._done.is_set():
                continue
            last_enabled, last_sent = state.enabled, time.monotonic()
            frame = encode_frame(FrameKind.STATE, self.node_id, state)
            now = time.monotonic()
            with self._state_lock:
                targets = [p for p in self._clients if self._backoff.ready(p, now)]
            for peer in targets:
                if self._stop.is_set():
                    return
                self._send(peer, frame)
            if self._done.is_set():
                return  # the final "disabled" broadcast went out

    # ------------------------------------------------------------------ metrics
    def _clip_bound(self) -> float | None:
        """The clip's current median bound; ``None`` without a clip or during its warm-up."""
        if self.clip is None:
            return None
        bound, warm = self.clip.bound()
        return None if warm else bound

    def metrics(self) -> dict[str, Any]:
        """JSON-able snapshot of the node's counters and accuracy history."""
        with self._state_lock:
            counters = counter_metrics(self._counters)
            pending = len(self._inbox)
        accuracy = list(self._accuracy)
        return {
            "node_id": self.node_id,
            "address": self.server.address,
            "secure": self.secure,
            "compressor": self.config.compressor or None,
            "steps": self._step,
            "target_steps": self.config.steps,
            "model_version": self._version,
            "steps_per_s": self._steps_per_s,
            "overlap": self.config.overlap,
            "ship_wait_s": self._ship_wait_s,
            "finished": self._done.is_set() and self._step >= self.config.steps,
            **counters,
            "pending": pending,
            "rejected": self.rejection_log.by_status(),
            "rejections": self.rejection_log.by_peer(),
            "clipped": self.clip_log.by_peer(),
            "clip_bound": self._clip_bound(),
            "attack": self.config.attack or None,
            "estimates": {str(k): list(v) for k, v in self.estimator.snapshot().items()},
            "accuracy": accuracy,
            "initial_accuracy": accuracy[0]["accuracy"] if accuracy else None,
            "final_accuracy": accuracy[-1]["accuracy"] if accuracy else None,
            "started_at": self._started_at,
            "finished_at": self._finished_at,
            "error": self.error,
        }
