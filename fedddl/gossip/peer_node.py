"""One real gossip node: trains, serves model exchanges, ships snapshots to scheduled peers.

Threads of a :class:`PeerNode`:

* **training** -- SGD steps on the node's shard; before each step it merges the
  models received since the previous one (under the model lock), so the step
  starts from the merged model as in the simulator, and it evaluates every
  ``eval_every`` steps. It never waits on the network (except with ``overlap=False``).
* **sender** -- whenever the model advanced since its last send, takes a
  snapshot (under the lock), asks the shared :class:`~fedddl.gossip.Scheduler`
  for a partner and ships it; measured transfer times feed the
  :class:`~fedddl.gossip.CommTimeEstimator`. Computation overlaps this.
  With ``overlap=False`` (classic gossip, the simulator's ``random`` baseline)
  there is no sender thread: the training thread ships a snapshot after each
  step (after its ``min_step_s`` pacing) and waits for the send to finish.
* **state** -- broadcasts the node's :class:`~fedddl.gossip.PeerState` (small
  STATE frames) when its ``enabled`` flag flips, at most every ``state_interval_s``.
* gRPC workers -- :meth:`PeerNode.handle_frame` validates every frame
  completely (checksum, size, sender, tensor names/shapes/dtypes, finite
  values) before it is queued for merging; a bad frame is refused with a
  status and never touches the model.

A peer that fails to answer within ``send_timeout_s`` is backed off
exponentially and treated as disabled, so a dead node slows nobody down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from fedddl.gossip.estimator import CommTimeEstimator
from fedddl.gossip.merge import merge_models, version_weight
from fedddl.gossip.scheduler import PeerState, get_scheduler
from fedddl.gossip.transport import (
    LinkShaper,
    PeerClient,
    PeerServer,
    RejectedFrame,
    TransportError,
)
from fedddl.gossip.wire import DEFAULT_MAX_FRAME_BYTES, FrameKind, decode_frame, encode_frame
from fedddl.training import (
    compute_gradients,
    evaluate,
    iterate_minibatches,
    parameters_fingerprint,
)

__all__ = ["NodeConfig", "PeerNode", "TrainingData"]

_log = logging.getLogger(__name__)
_MAX_BACKOFF_S = 5.0
_FINISHED = "node has finished training"
_STATE_REFRESH_S = 1.0  # re-broadcast the state at least this often (versions, speed)


@dataclass(frozen=True)
class NodeConfig:
    """Settings of one gossip node (see ``python -m fedddl.gossip.peer --help``)."""

    node_id: int
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 0.1
    scheduler: str = "scheduled"
    merge: str = "average"  # "average" (weight 0.5) or "version" (age-weighted)
    eval_every: int = 25
    min_step_s: float = 0.0  # pace steps to emulate slower compute
    send_timeout_s: float = 2.0
    overlap: bool = True  # compute while sending; False: wait for each send after a step
    state_interval_s: float = 0.2
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "node_id": self.node_id >= 0,
            "steps": self.steps >= 0,
            "batch_size": self.batch_size >= 1,
            "learning_rate": self.learning_rate > 0,
            "eval_every": self.eval_every >= 1,
            "min_step_s": self.min_step_s >= 0,
            "send_timeout_s": self.send_timeout_s > 0,
            "state_interval_s": self.state_interval_s > 0,
            "max_frame_bytes": self.max_frame_bytes > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"NodeConfig.{name} is out of range: {getattr(self, name)!r}")
        if self.merge not in ("average", "version"):
            raise ValueError(f"NodeConfig.merge must be 'average' or 'version', got {self.merge!r}")
        get_scheduler(self.scheduler)  # fails early on an unknown name


@dataclass
class TrainingData:
    """The node's shard and the shared test set, as tensors."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass
class _Counters:
    received_from: dict[int, int] = field(default_factory=dict)
    sent_to: dict[int, int] = field(default_factory=dict)
    merged: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    send_failures: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    transfer_s_sum: dict[int, float] = field(default_factory=dict)
    transfers: dict[int, int] = field(default_factory=dict)


class PeerNode:
    """A gossip node serving on gRPC and training in background threads.

    Parameters
    ----------
    config : NodeConfig
        Node settings.
    model : torch.nn.Module
        The local model (all nodes usually start from the same seed).
    data : TrainingData
        Shard and test set.
    bind : str
        ``host:port`` to serve on; port 0 picks a free one.
    shaper : LinkShaper, optional
        Artificial per-peer link delays.
    estimator : CommTimeEstimator, optional
        Transfer-time estimator (a default one if omitted).
    """

    def __init__(
        self,
        config: NodeConfig,
        model: torch.nn.Module,
        data: TrainingData,
        bind: str = "127.0.0.1:0",
        shaper: LinkShaper | None = None,
        estimator: CommTimeEstimator | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.data = data
        self.shaper = shaper or LinkShaper()
        self.estimator = estimator or CommTimeEstimator()
        self.scheduler = get_scheduler(config.scheduler)
        self._optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
        self._spec = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        self._model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        self._model_lock = threading.Lock()  # model, version
        self._state_lock = threading.Lock()  # pending, peer states, counters, clients
        self._version = 0
        self._step = 0
        self._steps_per_s = 0.0
        self._ship_wait_s = 0.0  # training time spent waiting for sends (overlap=False)
        self._pending: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
        self._receiving = 0  # frames being handled right now: our "downlink" is busy
        self._peer_states: dict[int, PeerState] = {}
        self._clients: dict[int, PeerClient] = {}
        self._backoff_until: dict[int, float] = {}
        self._failures: dict[int, int] = {}
        self._finished_peers: set[int] = set()
        self._counters = _Counters()
        self._accuracy: list[dict[str, float]] = []
        self._rng = np.random.default_rng([config.seed, config.node_id])
        self._started_at = time.time()
        self._finished_at: float | None = None
        self.error: str | None = None  # why training stopped early, if it crashed
        self._training = threading.Event()
        self._done = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.server = PeerServer(self.handle_frame, bind, config.max_frame_bytes)

    # ------------------------------------------------------------------ lifecycle
    @property
    def node_id(self) -> int:
        """This node's id."""
        return self.config.node_id

    def serve(self) -> None:
        """Start the gRPC service (frames are accepted once training starts)."""
        self.server.start()

    def set_peers(self, peers: Mapping[int, str]) -> None:
        """Set the other nodes' addresses (its own id is ignored)."""
        with self._state_lock:
            for node, address in peers.items():
                if node == self.node_id or node in self._clients:
                    continue
                self._clients[node] = PeerClient(node, address, self.shaper)
                self._peer_states[node] = PeerState(node, True, 0)

    def start_training(self, run_threads: bool = True) -> None:
        """Start accepting models and run the training, sender and state threads.

        With ``run_threads=False`` the node only accepts frames; the caller merges
        them with :meth:`merge_pending` (tests, embedding in another loop).
        """
        if self._training.is_set():
            raise RuntimeError("training already started")
        self._started_at = time.time()
        self._training.set()
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
    def handle_frame(self, data: bytes) -> bytes:
        """Validate one incoming frame, queue a model for merging, reply with an ACK.

        Raises
        ------
        WireError
            Malformed, truncated, oversized or corrupted frame.
        RejectedFrame
            Unknown sender, model that does not fit ours, or node not ready.
        """
        with self._state_lock:
            self._receiving += 1
        try:
            self._accept(data)
        finally:
            with self._state_lock:
                self._receiving -= 1
        return encode_frame(FrameKind.ACK, self.node_id, self.own_state())

    def _accept(self, data: bytes) -> None:
        frame = decode_frame(data, self.config.max_frame_bytes)
        if frame.sender == self.node_id:
            raise RejectedFrame(grpc.StatusCode.PERMISSION_DENIED, "frame claims to be from me")
        with self._state_lock:
            known = frame.sender in self._clients
        if not known:
            raise RejectedFrame(
                grpc.StatusCode.PERMISSION_DENIED, f"sender {frame.sender} is not a known peer"
            )
        if frame.kind is FrameKind.MODEL:
            self._check_model(frame.tensors)
            if self._done.is_set():
                raise RejectedFrame(grpc.StatusCode.UNAVAILABLE, _FINISHED)
            if not self._training.is_set():
                raise RejectedFrame(grpc.StatusCode.UNAVAILABLE, "node has not started training")
        with self._state_lock:
            self._peer_states[frame.sender] = frame.state
            self._counters.bytes_received += len(data)
            if frame.kind is FrameKind.MODEL:
                self._pending[frame.sender] = (frame.tensors, frame.state.model_version)
                received = self._counters.received_from
                received[frame.sender] = received.get(frame.sender, 0) + 1

    def _check_model(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if set(tensors) != set(self._spec):
            diff = sorted(set(tensors) ^ set(self._spec))
            raise RejectedFrame(
                grpc.StatusCode.FAILED_PRECONDITION, f"tensor names differ from my model: {diff}"
            )
        for name, tensor in tensors.items():
            shape, dtype = self._spec[name]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise RejectedFrame(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, mine is"
                    f" {shape} {dtype}",
                )
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise RejectedFrame(
                    grpc.StatusCode.INVALID_ARGUMENT, f"tensor {name!r} has non-finite values"
                )

    # ------------------------------------------------------------------ state
    def own_state(self) -> PeerState:
        """This node's shareable state: enabled = training and not receiving a frame right now."""
        with self._state_lock:
            enabled = self._training.is_set() and not self._done.is_set() and not self._receiving
            estimates = {p: self.estimator.estimate(p, self._model_bytes) for p in self._clients}
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
        """Merge the models received since the last merge; returns how many."""
        with self._model_lock:
            return self._merge_pending_locked()

    def _merge_pending_locked(self) -> int:
        with self._state_lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return 0
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for tensors, version in pending.values():
            weight = 0.5 if self.config.merge == "average" else version_weight(
                self._version, version
            )
            state = merge_models(state, tensors, weight)
            self._version = max(self._version, version)  # Lamport clock over SGD steps
        self.model.load_state_dict(state)
        with self._state_lock:
            self._counters.merged += len(pending)
        return len(pending)

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
        """Send a snapshot of the model to a scheduled peer.

        Returns its version if it was delivered, -1 if the send failed, None if no
        peer could be chosen.
        """
        with self._model_lock:
            version = self._version
            snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        frame = encode_frame(FrameKind.MODEL, self.node_id, self.own_state(), snapshot)
        peer = self._choose_peer(len(frame))
        if peer is None:
            return None
        if not self._send(peer, frame, is_model=True):
            return -1
        with self._state_lock:
            self._counters.sent_to[peer] = self._counters.sent_to.get(peer, 0) + 1
        return version

    def _choose_peer(self, frame_bytes: int) -> int | None:
        now = time.monotonic()
        with self._state_lock:
            states = {
                p: s
                for p, s in self._peer_states.items()
                if self._backoff_until.get(p, 0.0) <= now and p not in self._finished_peers
            }
        if not states:
            return None
        states[self.node_id] = self.own_state()
        return self.scheduler.choose_peer(
            self.node_id, states, frame_bytes, self.estimator, self._rng
        )

    def _send(self, peer: int, frame: bytes, is_model: bool = False) -> bool:
        with self._state_lock:
            client = self._clients[peer]
        try:
            result = client.send(frame, self.config.send_timeout_s)
            reply = decode_frame(result.reply, self.config.max_frame_bytes)
        except (TransportError, ValueError) as exc:
            self._on_send_failure(peer, exc)
            return False
        with self._state_lock:
            self._counters.bytes_sent += len(frame)
            if is_model:  # the estimator models model messages; STATE pings would skew it
                self.estimator.observe(peer, len(frame), result.seconds)
                sums = self._counters.transfer_s_sum
                sums[peer] = sums.get(peer, 0.0) + result.seconds
                self._counters.transfers[peer] = self._counters.transfers.get(peer, 0) + 1
            self._peer_states[peer] = reply.state
            self._failures[peer] = 0
            self._backoff_until.pop(peer, None)
        return True

    def _on_send_failure(self, peer: int, exc: Exception) -> None:
        code = exc.code if isinstance(exc, TransportError) else None
        with self._state_lock:
            if code is grpc.StatusCode.UNAVAILABLE and _FINISHED in str(exc):
                self._finished_peers.add(peer)  # it is done: stop choosing it
                return
            self._counters.send_failures += 1
            failures = self._failures.get(peer, 0) + 1
            self._failures[peer] = failures
            backoff = min(0.25 * 2 ** (failures - 1), _MAX_BACKOFF_S)
            self._backoff_until[peer] = time.monotonic() + backoff
            state = self._peer_states.get(peer)
            if state is not None:
                self._peer_states[peer] = PeerState(
                    peer, False, state.model_version, state.est_comm_time_s, state.steps_per_s
                )
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
                targets = [p for p in self._clients if self._backoff_until.get(p, 0.0) <= now]
            for peer in targets:
                if self._stop.is_set():
                    return
                self._send(peer, frame)
            if self._done.is_set():
                return  # the final "disabled" broadcast went out

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        """JSON-able snapshot of the node's counters and accuracy history."""
        with self._state_lock:
            counters = asdict(self._counters)
            pending = len(self._pending)
        accuracy = list(self._accuracy)
        return {
            "node_id": self.node_id,
            "address": self.server.address,
            "steps": self._step,
            "target_steps": self.config.steps,
            "model_version": self._version,
            "steps_per_s": self._steps_per_s,
            "overlap": self.config.overlap,
            "ship_wait_s": self._ship_wait_s,
            "finished": self._done.is_set() and self._step >= self.config.steps,
            "received": sum(counters["received_from"].values()),
            "received_from": {str(k): v for k, v in counters["received_from"].items()},
            "sent": sum(counters["sent_to"].values()),
            "sent_to": {str(k): v for k, v in counters["sent_to"].items()},
            "merged": counters["merged"],
            "pending": pending,
            "bytes_sent": counters["bytes_sent"],
            "bytes_received": counters["bytes_received"],
            "send_failures": counters["send_failures"],
            "rejected": dict(self.server.rejections),
            "mean_transfer_s": {
                str(k): total / counters["transfers"][k]
                for k, total in counters["transfer_s_sum"].items()
            },
            "estimates": {str(k): list(v) for k, v in self.estimator.snapshot().items()},
            "accuracy": accuracy,
            "initial_accuracy": accuracy[0]["accuracy"] if accuracy else None,
            "final_accuracy": accuracy[-1]["accuracy"] if accuracy else None,
            "started_at": self._started_at,
            "finished_at": self._finished_at,
            "error": self.error,
        }
