"""One real gossip node: trains, serves model exchanges, ships models to scheduled peers.

A :class:`PeerNode` runs a training thread (merges what arrived, then steps; never waits
on the network unless ``overlap=False``) and the two threads of its
:class:`~fedddl.gossip.sender.Sender`: one ships a snapshot, a MODEL frame or a
compressed DELTA frame, to the partner its ``Scheduler`` picks, the other broadcasts its
:class:`~fedddl.gossip.scheduler.PeerState`. Node and sender share their peer states,
counters, inbox and locks through one :class:`~fedddl.gossip.shared_state.SharedState`.
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
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc
import torch

from fedddl.gossip.admission import Admission, RejectedFrame, RejectionLog
from fedddl.gossip.attack import poison_state
from fedddl.gossip.clip import MergeClip, clip_level, difference
from fedddl.gossip.compressed import CompressedGossip, LinkError, add_correction
from fedddl.gossip.estimator import CommTimeEstimator
from fedddl.gossip.frame_checks import check_frame
from fedddl.gossip.held_frames import NOT_READY, HeldFrames
from fedddl.gossip.merge import merge_models, version_weight
from fedddl.gossip.node_config import NodeConfig, TrainingData
from fedddl.gossip.node_metrics import counter_metrics
from fedddl.gossip.peer_backoff import FINISHED
from fedddl.gossip.scheduler import PeerState, get_scheduler
from fedddl.gossip.sender import Sender, SenderHooks, first_frame_bytes
from fedddl.gossip.shared_state import SharedState
from fedddl.gossip.tls import PeerTls, require_loopback
from fedddl.gossip.transport import LinkShaper, PeerClient, PeerServer
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
        gossip = None
        if config.compressor:
            gossip = CompressedGossip(
                config.compressor,
                state,
                seed=derive_seed(config.seed, config.node_id, 0xC0),
                consensus_step=config.consensus_step,
                scale_bucket=config.scale_bucket,
                max_abs_weight=config.limits.max_abs_weight,
            )
        self._shared = SharedState(first_frame_bytes(config.node_id, gossip, state), gossip)
        self.admission = Admission(config.limits)
        self.rejection_log = RejectionLog(f"node {config.node_id}")
        self.clip_log = RejectionLog(f"node {config.node_id}", action="clipped")
        self._initial = {k: v.detach().clone() for k, v in state.items()}
        self.clip = MergeClip(config.clip, state) if config.clip > 0 else None
        self._version = 0
        self._step = 0
        self._steps_per_s = 0.0
        self._ship_wait_s = 0.0  # training time spent waiting for sends (overlap=False)
        self._held = HeldFrames(config.hold_limit)
        self._receiving = 0  # frames being handled right now: our "downlink" is busy
        self._accuracy: list[dict[str, float]] = []
        self._started_at = time.time()
        self._finished_at: float | None = None
        self.error: str | None = None  # why training stopped early, if it crashed
        self._training = threading.Event()
        self._threads: list[threading.Thread] = []
        hooks = SenderHooks(self.own_state, lambda: self._version, self._outgoing, self._clipped)
        self._sender = Sender(
            config, self._shared, hooks, self.scheduler, self.estimator,
            self.admission, self.rejection_log,
        )
        self.server = PeerServer(
            self.handle_frame, bind, config.max_frame_bytes, tls=tls, rejections=self.rejection_log
        )

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
        with self._shared.state_lock:
            for node, address in peers.items():
                if node == self.node_id or node in self._shared.clients:
                    continue
                self._shared.clients[node] = PeerClient(node, address, self.shaper, self.tls)
                self._shared.peer_states[node] = PeerState(node, True, 0)

    def start_training(self, run_threads: bool = True) -> None:
        """Admit the held frames and run the training, sender and state threads.

        With ``run_threads=False`` the node only accepts frames; the caller merges
        them with :meth:`merge_pending` (tests, embedding in another loop).
        """
        with self._shared.state_lock:
            if self._training.is_set():
                raise RuntimeError("training already started")
            self._started_at = time.time()
            self._training.set()
            held = self._held.take()
        for frame, num_bytes in held:
            try:
                self._admit(frame, num_bytes)
            except RejectedFrame as exc:
                with self._shared.state_lock:
                    self._shared.counters.held_dropped += 1
                self.rejection_log.record(
                    f"node {frame.sender}", exc.key, exc.code.name, f"held frame: {exc.reason}"
                )
        if not run_threads:
            return
        loops = [(self._train_loop, "train"), (self._sender.state_loop, "state")]
        if self.config.overlap:
            loops.append((self._sender.send_loop, "sender"))
        for target, name in loops:
            thread = threading.Thread(target=target, name=f"node{self.node_id}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Wait until training finished (or was stopped); True if it did."""
        return self._shared.done.wait(timeout_s)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop all threads and the service; safe to call twice."""
        self._shared.stop.set()
        for thread in self._threads:
            thread.join(timeout=self.config.send_timeout_s + grace_s)
        self.server.stop(grace_s)
        with self._shared.state_lock:
            clients = list(self._shared.clients.values())
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
        with self._shared.state_lock:
            self._receiving += 1
        try:
            frame = self._check(data, caller)
            if not self._hold(frame, len(data)):
                self._admit(frame, len(data))
        finally:
            with self._shared.state_lock:
                self._receiving -= 1
        return encode_frame(FrameKind.ACK, self.node_id, self.own_state())

    def _check(self, data: bytes, caller: int | None) -> Frame:
        """Checks that need no peer list: format, identity, model shape."""
        frame = decode_frame(data, self.config.max_frame_bytes)
        compressed = self._shared.gossip is not None
        check_frame(frame, self.node_id, caller, self.secure, compressed, self._spec)
        return frame

    def _hold(self, frame: Frame, num_bytes: int) -> bool:
        """Hold a frame that arrives before training starts; False once it has started."""
        with self._shared.state_lock:
            if self._training.is_set():
                return False
            self._held.hold(frame, num_bytes)
            self._shared.counters.held += 1
        return True

    def _admit(self, frame: Frame, num_bytes: int) -> None:
        """Checks against the peer list and the limits; then queue the frame's content."""
        sender = frame.sender
        with self._shared.state_lock:
            known = sender in self._shared.clients
        if not known:
            raise RejectedFrame(
                grpc.StatusCode.PERMISSION_DENIED,
                f"sender {sender} is not a known peer",
                "unknown-sender",
                sender,
            )
        version = frame.state.model_version
        if frame.kind.carries_model:
            if self._shared.done.is_set():
                raise RejectedFrame(grpc.StatusCode.UNAVAILABLE, FINISHED, "finished", sender)
            self.admission.take_model_slot(sender)
        self.admission.check_version(sender, version, self._version)
        correction: dict[str, torch.Tensor] | None = None
        if frame.kind is FrameKind.MODEL:
            self.admission.check_weights(sender, frame.tensors)
        elif frame.kind is FrameKind.DELTA:
            correction = self._clipped(sender, self._receive_delta(frame))
        self.admission.accept_version(version)
        with self._shared.state_lock:
            self._shared.peer_states[sender] = frame.state
            self._shared.counters.bytes_received += num_bytes
            if frame.kind is FrameKind.MODEL:
                self._shared.inbox.add_model(sender, frame.tensors, version)
            elif correction is not None:
                self._shared.inbox.add_correction(correction, version)
            if frame.kind.carries_model:
                received = self._shared.counters.received_from
                received[sender] = received.get(sender, 0) + 1

    def _receive_delta(self, frame: Frame) -> dict[str, torch.Tensor]:
        assert self._shared.gossip is not None and frame.link is not None
        try:
            with self._shared.links_lock:
                return self._shared.gossip.receive(frame.sender, frame.link, frame.update)
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
        shared = self._shared
        with shared.state_lock:
            enabled = self._training.is_set() and not shared.done.is_set() and not self._receiving
            size = shared.frame_bytes
            estimates = {p: self.estimator.estimate(p, size) for p in shared.clients}
        return PeerState(self.node_id, enabled, self._version, estimates, self._steps_per_s)

    def fingerprint(self) -> str:
        """SHA-256 of the model's parameters and buffers."""
        with self._model_lock:
            return parameters_fingerprint(self.model)

    def _outgoing(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The model's version and a copy of it to send (poisoned on a compromised node)."""
        with self._model_lock:
            version = self._version
            snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.config.attack:
            snapshot = poison_state(
                self.config.attack, snapshot, self._initial, self.config.attack_scale
            )
        return version, snapshot

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
            while self._step < cfg.steps and not self._shared.stop.is_set():
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
                    self._shared.stop.wait(spare)
                if not cfg.overlap:
                    ship_start = time.perf_counter()
                    self._sender.ship_snapshot()
                    self._ship_wait_s += time.perf_counter() - ship_start
                self._steps_per_s = self._step / max(time.perf_counter() - began, 1e-9)
        except Exception as exc:
            self.error = f"training failed: {exc!r}"
            _log.exception("node %d: training failed", self.node_id)
        finally:
            self._finished_at = time.time()
            self._shared.done.set()

    def merge_pending(self) -> int:
        """Merge what was received since the last merge; returns how many updates."""
        with self._model_lock:
            return self._merge_pending_locked()

    def _merge_pending_locked(self) -> int:
        with self._shared.state_lock:
            received = self._shared.inbox.take()
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
        with self._shared.state_lock:
            self._shared.counters.merged += merged
        return merged

    def _record_accuracy(self) -> None:
        with self._model_lock:
            _, accuracy = evaluate(self.model, self.data.x_test, self.data.y_test)
        self._accuracy.append(
            {"step": self._step, "t": time.time() - self._started_at, "accuracy": accuracy}
        )

    # ------------------------------------------------------------------ metrics
    def _clip_bound(self) -> float | None:
        """The clip's current median bound; ``None`` without a clip or during its warm-up."""
        if self.clip is None:
            return None
        bound, warm = self.clip.bound()
        return None if warm else bound

    def metrics(self) -> dict[str, Any]:
        """JSON-able snapshot of the node's counters and accuracy history."""
        with self._shared.state_lock:
            counters = counter_metrics(self._shared.counters)
            pending = len(self._shared.inbox)
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
            "finished": self._shared.done.is_set() and self._step >= self.config.steps,
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
