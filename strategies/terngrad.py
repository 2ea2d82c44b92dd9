"""TernGrad: localized replicas, ternary gradients up, compressed aggregate down.

A round (one message per sampled client):

1. ``configure_train``: each sampled client gets the encoded broadcast updates it
   misses (normally just the previous round's aggregate) from a bounded log, or a
   snapshot of the server's shadow replica when it is further behind, plus the
   version it must reach before computing.
2. The client applies them with the shared optimiser, computes its (pseudo-)gradient
   on its shard, encodes it and replies with payload, fingerprint and version.
3. ``aggregate_train``: replies are validated one by one (error, records, version,
   fingerprint, payload decode, names and shapes); bad ones are logged and left out.
   The mean of the accepted gradients is encoded for the downlink, decoded exactly as
   the clients will decode it, applied to the shadow replica, and logged as the next
   version. The returned ArrayRecord is the shadow replica (server-local, never sent),
   which the server app evaluates on the held-out split.

Model weights never travel, except as a catch-up snapshot.

A round with fewer than ``min_replies`` valid replies applies no update: it is
logged, every replica keeps its version and the next round starts from there.

Checkpoint and resume: :meth:`TernGrad.checkpoint` captures the shadow replica,
its optimiser state, the version, the update log and the server-side downlink
state (error-feedback residuals, shared scales); :meth:`TernGrad.restore` loads
one and sets :attr:`TernGrad.round_offset`, so a restarted run numbers its rounds
globally (the seeds of sampling, server and client compressors and minibatches are
derived from the global round, and a resumed run continues the same trajectory).
After a restore the server knows nothing about the clients' replicas: each node's
first message is a snapshot (a node may even be *ahead* of the checkpoint, with
updates the crashed server broadcast after saving it, which no replay can undo).
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import nn

from fedddl.checkpoint import CheckpointError, ServerCheckpoint
from fedddl.compression import PayloadError, ResidualMemory, decode_update
from fedddl.replica import Replica, ReplicaError, UpdateLog, check_update, plan_catch_up
from strategies.downlink import (
    decode_broadcast,
    encode_reencoded,
    encode_shared_sum,
    ternary_codes,
)
from strategies.strategy_utils import (
    ClientReply,
    ReplyError,
    TrainInstruction,
    build_train_content,
    derive_seed,
    fingerprint_prefix,
    make_compressor,
    mean_updates,
    parse_reply,
)

__all__ = ["FingerprintMismatch", "RoundReport", "TernGrad"]


class FingerprintMismatch(ReplyError):
    """A client's replica differs from the shadow replica at the same version."""


@dataclass
class RoundReport:
    """What happened in one round on the server.

    Attributes
    ----------
    server_round : int
        Round number.
    version : int
        Shadow replica version after the round.
    accepted : list[int]
        Nodes whose gradients were aggregated.
    dropped : dict[int, str]
        Nodes left out, with the reason.
    replicas_equal : bool | None
        Whether every reply's fingerprint matched the shadow replica (None: none checked).
    downlink_format : str
        ``"encoded"``, ``"shared-scale-sum"`` or ``"none"`` (no update this round).
    loss : float
        Mean training loss of the accepted replies.
    aggregate_s : float
        Seconds spent in ``aggregate_train``.
    skipped : bool
        Whether the round applied no update because it had fewer than ``min_replies``
        valid replies (``accepted`` then lists the valid ones that were not applied).
    """

    server_round: int
    version: int = 0
    accepted: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    replicas_equal: bool | None = None
    downlink_format: str = "none"
    loss: float = math.nan
    aggregate_s: float = 0.0
    skipped: bool = False


class TernGrad(Strategy):
    """Synchronous data-parallel SGD with ternary gradients and a versioned shadow replica.

    Parameters
    ----------
    model_fn : Callable[[], torch.nn.Module]
        Builds the seeded initial model (identical to what every client builds).
    learning_rate, momentum : float
        The shared SGD optimiser applied by every replica.
    compressor : str
        Registered uplink compressor name (also used to re-encode the downlink).
    clip_sigma : float
        Ternary clipping passed to the built-in ternary compressors.
    downlink : str
        ``"reternarize"`` or ``"shared-scale-sum"``.
    fraction_train : float
        Fraction of connected nodes sampled per round.
    min_available_nodes : int
        Nodes to wait for before sampling.
    update_log_size : int
        Broadcast updates kept for catch-up; further behind gets a snapshot.
    seed : int
        Seeds node sampling and the server-side compressor.
    wait_timeout : float
        Seconds to wait for ``min_available_nodes`` before failing.
    min_replies : int
        Valid replies needed to apply a round's update (fewer: the round is skipped).

    Attributes
    ----------
    round_offset : int
        Added to Flower's round number to get the global round (set by :meth:`restore`).
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        *,
        learning_rate: float = 0.1,
        momentum: float = 0.9,
        compressor: str = "ternary",
        clip_sigma: float = 2.5,
        downlink: str = "reternarize",
        fraction_train: float = 1.0,
        min_available_nodes: int = 2,
        update_log_size: int = 8,
        seed: int = 0,
        wait_timeout: float = 600.0,
        min_replies: int = 1,
    ) -> None:
        if downlink not in ("reternarize", "shared-scale-sum"):
            raise ValueError(
                f"downlink must be 'reternarize' or 'shared-scale-sum', got {downlink!r}"
            )
        if not 0 < fraction_train <= 1:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if min_replies < 1:
            raise ValueError(f"min_replies must be >= 1, got {min_replies}")
        self.min_replies = min_replies
        self.round_offset = 0
        self._unknown_version = 0  # assumed version of a node never heard from
        self._compressor_arg = compressor
        self.clip_sigma = clip_sigma
        self.downlink = downlink
        self.fraction_train = fraction_train
        self.min_available_nodes = min_available_nodes
        self.seed = seed
        self.wait_timeout = wait_timeout
        make_compressor(self.compressor_name(), clip_sigma=clip_sigma, seed=0)  # validates name
        self.shadow = Replica(model_fn(), learning_rate, momentum, version=0)
        self.param_names = [n for n, p in self.shadow.model.named_parameters() if p.requires_grad]
        self.log = UpdateLog(update_log_size)
        self.fingerprints: OrderedDict[int, str] = OrderedDict({0: self.shadow.fingerprint()})
        self.node_version: dict[int, int] = {}
        self.node_knows_compressor: set[int] = set()
        self.expected_version: dict[int, int] = {}
        self.server_memory = ResidualMemory()
        self.shared_scales: torch.Tensor | None = None
        self.reports: list[RoundReport] = []

    # ------------------------------------------------------------- overridables
    def compressor_name(self) -> str:
        """Name of the compressor clients use for the uplink (and the server to re-encode)."""
        return self._compressor_arg

    # ------------------------------------------------------------------ helpers
    @property
    def last_report(self) -> RoundReport | None:
        """The report of the latest aggregated round."""
        return self.reports[-1] if self.reports else None

    def _wants_shared_sum(self) -> bool:
        return self.downlink == "shared-scale-sum" and self.compressor_name().startswith("ternary")

    def _sample(self, grid: Grid, server_round: int) -> list[int]:
        deadline = time.monotonic() + self.wait_timeout
        while len(nodes := sorted(grid.get_node_ids())) < self.min_available_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(nodes)} nodes connected after {self.wait_timeout}s, "
                    f"need {self.min_available_nodes}"
                )
            log(INFO, "Waiting for nodes: %d of %d", len(nodes), self.min_available_nodes)
            time.sleep(1)
        k = max(1, int(len(nodes) * self.fraction_train + 1e-9))  # as Flower: floor, >= 1
        if k >= len(nodes):
            return nodes
        rng = random.Random(derive_seed(self.seed, server_round, 17))
        return sorted(rng.sample(nodes, k))

    def _record_fingerprint(self) -> None:
        self.fingerprints[self.shadow.version] = self.shadow.fingerprint()
        while len(self.fingerprints) > max(64, 2 * len(self.log) + 2):
            self.fingerprints.popitem(last=False)

    # ------------------------------------------------------------ configure
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled node: missed updates (or a snapshot) + compute order."""
        del arrays, config  # the protocol never broadcasts weights
        server_round += self.round_offset
        nodes = self._sample(grid, server_round)
        current = self.shadow.version
        snapshot = None
        contents: dict[tuple[str, int, bool], RecordDict] = {}
        messages: list[Message] = []
        want_scales = self._wants_shared_sum()
        for node in nodes:
            known = self.node_version.get(node, self._unknown_version)
            plan = plan_catch_up(known, current, self.log)
            tell = node not in self.node_knows_compressor or plan.kind == "snapshot"
            key = (plan.kind, known if plan.kind == "log" else -2, tell)
            content = contents.get(key)
            if content is None:
                if plan.kind == "snapshot" and snapshot is None:
                    snapshot = self.shadow.snapshot()
                instruction = TrainInstruction(
                    server_round=server_round,
                    model_version=current,
                    updates=plan.updates,
                    snapshot=snapshot if plan.kind == "snapshot" else None,
                    snapshot_version=current if plan.kind == "snapshot" else -1,
                    compressor=self.compressor_name() if tell else None,
                    scales=self.shared_scales if want_scales else None,
                    want_scales=want_scales,
                )
                content = build_train_content(instruction)
                contents[key] = content
            self.expected_version[node] = current
            messages.append(
                Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
            )
        log(INFO, "configure_train: %d nodes, model version %d", len(messages), current)
        return messages

    # ------------------------------------------------------------ aggregate
    def _validate(self, message: Message) -> tuple[ClientReply, dict[str, torch.Tensor]]:
        """Parse and check one reply; raise ``ReplyError`` with the reason."""
        reply = parse_reply(message)
        node = reply.node_id
        expected = self.expected_version.pop(node, None)  # one reply per node and round
        if expected is None:
            raise ReplyError(f"node {node} was not sent a message this round or already replied")
        if reply.resync:
            self.node_version[node] = reply.model_version
            if reply.model_version < 0:
                self.node_knows_compressor.discard(node)
            raise ReplyError(f"node {node} asks to resync from version {reply.model_version}")
        if reply.model_version != expected:
            self.node_version[node] = reply.model_version
            raise ReplyError(
                f"node {node} is at version {reply.model_version}, expected {expected}"
            )
        self.node_knows_compressor.add(node)
        want = self.fingerprints.get(expected)
        if want is not None and reply.fingerprint != fingerprint_prefix(want).hex():
            self.node_version[node] = -1  # diverged replica: resync with a snapshot
            raise FingerprintMismatch(f"node {node} fingerprint mismatch at version {expected}")
        self.node_version[node] = expected
        assert reply.payload is not None
        try:
            decoded = decode_update(reply.payload)
            check_update(self.shadow.model, decoded)
        except (PayloadError, ReplicaError) as err:
            raise ReplyError(f"node {node} payload rejected: {err}") from err
        except Exception as err:  # a decoder bug on hostile input must not end the round
            raise ReplyError(f"node {node} payload rejected: {type(err).__name__}: {err}") from err
        return reply, decoded

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, average accepted gradients, broadcast-encode, update the shadow."""
        start = time.perf_counter()
        server_round += self.round_offset
        report = RoundReport(server_round)
        accepted: list[tuple[ClientReply, dict[str, torch.Tensor]]] = []
        fingerprint_checked = False
        mismatch = False
        for message in replies:
            node = int(message.metadata.src_node_id)
            try:
                reply, decoded = self._validate(message)
            except ReplyError as err:
                report.dropped[node] = str(err)
                if isinstance(err, FingerprintMismatch):
                    mismatch = True
                    fingerprint_checked = True
                log(WARNING, "aggregate_train: dropping reply: %s", err)
                continue
            fingerprint_checked = True
            accepted.append((reply, decoded))
        self.expected_version.clear()
        report.accepted = sorted(r.node_id for r, _ in accepted)
        report.replicas_equal = (not mismatch) if fingerprint_checked else None
        if accepted and len(accepted) < self.min_replies:
            log(
                WARNING,
                "aggregate_train: round %d skipped: %d valid replies, need %d; "
                "no update applied, model version stays %d",
                server_round,
                len(accepted),
                self.min_replies,
                self.shadow.version,
            )
            report.loss = sum(r.loss for r, _ in accepted) / len(accepted)
            report.skipped = True
            accepted = []
        elif not accepted:
            report.skipped = True
            log(WARNING, "aggregate_train: round %d has no valid reply, no update", server_round)
        if accepted:
            report.loss = sum(r.loss for r, _ in accepted) / len(accepted)
            payload, report.downlink_format = self._encode_downlink(server_round, accepted)
            update = decode_broadcast(payload)  # exactly what every client will apply
            self.shadow.apply_update(update, self.shadow.version + 1)
            self.log.append(self.shadow.version, payload)
            self._record_fingerprint()
            self._update_shared_scales(accepted)
        report.version = self.shadow.version
        report.aggregate_s = time.perf_counter() - start
        self.reports.append(report)
        log(
            INFO,
            "aggregate_train: %d accepted, %d dropped, version %d, replicas equal: %s",
            len(report.accepted),
            len(report.dropped),
            report.version,
            report.replicas_equal,
        )
        metrics = MetricRecord(
            {
                "num-accepted": len(report.accepted),
                "num-dropped": len(report.dropped),
                "model-version": report.version,
                "replicas-equal": -1
                if report.replicas_equal is None
                else int(report.replicas_equal),
            }
        )
        if not math.isnan(report.loss):
            metrics["train-loss"] = report.loss
        return ArrayRecord(self.shadow.model.state_dict()), metrics

    def _encode_downlink(
        self, server_round: int, accepted: list[tuple[ClientReply, dict[str, torch.Tensor]]]
    ) -> tuple[bytes, str]:
        """Return the broadcast payload of this round's aggregate and its format."""
        if self._wants_shared_sum() and self.shared_scales is not None:
            payload = self._shared_sum(accepted)
            if payload is not None:
                return payload, "shared-scale-sum"
        aggregate = mean_updates([d for _, d in accepted])
        compressor = make_compressor(
            self.compressor_name(),
            clip_sigma=self.clip_sigma,
            seed=derive_seed(self.seed, server_round, 1 << 40),
        )
        return encode_reencoded(aggregate, compressor, self.server_memory), "encoded"

    def _shared_sum(
        self, accepted: list[tuple[ClientReply, dict[str, torch.Tensor]]]
    ) -> bytes | None:
        """Sum the clients' ternary codes at the shared scales (None if any is not ternary)."""
        assert self.shared_scales is not None
        scales = dict(zip(self.param_names, self.shared_scales.tolist(), strict=True))
        sums: dict[str, torch.Tensor] = {}
        for name in self.param_names:
            total = torch.zeros(accepted[0][1][name].numel(), dtype=torch.int32)
            for _, decoded in accepted:
                codes = ternary_codes(decoded[name], scales[name])
                if codes is None:
                    return None
                total += codes.to(torch.int32)
            sums[name] = total
        shapes = {n: tuple(accepted[0][1][n].shape) for n in self.param_names}
        return encode_shared_sum(sums, scales, shapes, len(accepted))

    def _update_shared_scales(
        self, accepted: list[tuple[ClientReply, dict[str, torch.Tensor]]]
    ) -> None:
        if not self._wants_shared_sum():
            return
        reported = [r.scales for r, _ in accepted if r.scales is not None]
        if not reported or any(s.shape != (len(self.param_names),) for s in reported):
            self.shared_scales = None
            return
        self.shared_scales = torch.stack(reported).max(dim=0).values

    # ----------------------------------------------------------- checkpoints
    def checkpoint(self, server_round: int, config: dict[str, object]) -> ServerCheckpoint:
        """Capture the server state after global round ``server_round``.

        Parameters
        ----------
        server_round : int
            The last completed global round (``round_offset`` included).
        config : dict
            The run config to store (checked on resume).
        """
        memory = self.server_memory.residuals
        return ServerCheckpoint(
            round=server_round,
            version=self.shadow.version,
            model_state={k: v.detach().clone() for k, v in self.shadow.model.state_dict().items()},
            optimizer_state=self.shadow.optimizer.state_dict(),
            update_log=self.log.since(-1),
            config=dict(config),
            rng_states={"torch": torch.get_rng_state()},
            strategy_state={
                "server_memory": memory,
                "shared_scales": self.shared_scales,
                "strategy_class": f"{type(self).__module__}.{type(self).__qualname__}",
            },
        )

    def restore(self, ckpt: ServerCheckpoint) -> None:
        """Continue from ``ckpt``: shadow replica, optimiser, version, log, downlink state.

        Raises
        ------
        CheckpointError
            If the checkpoint does not fit this strategy's model or optimiser; the
            strategy is left unchanged.
        """
        saved_class = ckpt.strategy_state.get("strategy_class")
        here = f"{type(self).__module__}.{type(self).__qualname__}"
        if saved_class is not None and saved_class != here:
            raise CheckpointError(f"checkpoint was made by {saved_class}, this run uses {here}")
        memory = ckpt.strategy_state.get("server_memory", {})
        scales = ckpt.strategy_state.get("shared_scales")
        if not isinstance(memory, dict) or not all(
            isinstance(t, torch.Tensor) for t in memory.values()
        ):
            raise CheckpointError("checkpoint server_memory must map names to tensors")
        if scales is not None and not isinstance(scales, torch.Tensor):
            raise CheckpointError("checkpoint shared_scales must be a tensor or None")
        log_entries = list(ckpt.update_log)
        if log_entries and log_entries[-1][0] != ckpt.version:
            raise CheckpointError(
                f"checkpoint update log ends at version {log_entries[-1][0]}, "
                f"not at the checkpoint version {ckpt.version}"
            )
        # Build everything on copies first so a bad checkpoint changes nothing.
        shadow = Replica(
            _clone_module(self.shadow.model),
            self.shadow.learning_rate,
            self.shadow.momentum,
            version=0,
        )
        ckpt.restore_model(shadow.model)
        try:
            shadow.optimizer.load_state_dict(ckpt.optimizer_state)
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"checkpoint optimizer state does not fit: {err}") from err
        for group in shadow.optimizer.param_groups:
            if group["lr"] != self.shadow.learning_rate or group["momentum"] != (
                self.shadow.momentum
            ):
                raise CheckpointError(
                    f"checkpoint optimizer has lr={group['lr']} momentum={group['momentum']}, "
                    f"this run lr={self.shadow.learning_rate} momentum={self.shadow.momentum}"
                )
        shadow.version = ckpt.version
        update_log = UpdateLog(self.log.capacity)
        for version, payload in log_entries:
            update_log.append(version, payload)
        server_memory = ResidualMemory()
        for name, residual in memory.items():
            server_memory.update(str(name), residual.clone(), torch.zeros_like(residual))
        self.shadow = shadow
        self.log = update_log
        self.server_memory = server_memory
        self.shared_scales = None if scales is None else scales.clone()
        self.round_offset = ckpt.round
        self.fingerprints = OrderedDict({shadow.version: shadow.fingerprint()})
        self.node_version.clear()
        self.node_knows_compressor.clear()
        self.expected_version.clear()
        self._unknown_version = -1  # every node's first message after a restart: snapshot
        rng = (ckpt.rng_states or {}).get("torch")
        if isinstance(rng, torch.Tensor):
            torch.set_rng_state(rng)
        log(
            INFO,
            "TernGrad restored from checkpoint: round %d, version %d, %d logged updates",
            ckpt.round,
            ckpt.version,
            len(update_log),
        )

    # ------------------------------------------------------------- evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: the server evaluates its shadow replica."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    def summary(self) -> None:
        """Log the strategy configuration."""
        log(INFO, "\t├──> Uplink compressor: %s", self.compressor_name())
        log(INFO, "\t├──> Downlink: %s", self.downlink)
        log(INFO, "\t├──> Fraction train: %.2f", self.fraction_train)
        log(INFO, "\t├──> Min replies: %d", self.min_replies)
        log(INFO, "\t└──> Update log size: %d", self.log.capacity)


def _clone_module(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)
