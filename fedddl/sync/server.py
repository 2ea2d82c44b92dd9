"""The server side of the localized-replica protocol, without Flower.

:class:`ReplicaServer` keeps the *shadow replica* (the model every client replica
equals at the same version), the bounded log of encoded broadcast updates, the
fingerprints of recent versions and what it knows about each node. Per round:

1. :meth:`ReplicaServer.plan_round` gives each sampled node a
   :class:`~fedddl.sync.messages.TrainInstruction`: the updates it misses from the log,
   or a snapshot of the shadow replica when it is further behind, and the version it must
   reach before computing.
2. :meth:`ReplicaServer.aggregate` takes the replies. Each is checked against the round
   (:meth:`validate_reply`: version, fingerprint) and its payload header against the model
   (:mod:`fedddl.sync.screening`), before anything is decoded; the header scales are
   bounded by the round's honest majority (:mod:`fedddl.sync.scale_bound`); the accepted
   replies are decoded one at a time into one buffer and combined in the order of the
   partitions the clients report (the same model whatever order they arrived in and
   whatever ids the nodes drew: float sums depend on their order)
   (:meth:`aggregate_gradients`, by default the configured aggregator of
   :mod:`fedddl.sync.robust`); the aggregate is encoded for the downlink
   (:meth:`encode_downlink`), decoded exactly as the clients will decode it, applied to the
   shadow replica and logged as the next version.

Client input never ends the server: any exception raised while handling one reply drops
that reply with a logged reason, and a round whose aggregate cannot be combined, encoded
or applied is skipped (logged, no update). Resyncs a node causes are rate-limited
(:mod:`fedddl.sync.resync_limit`). The settings are :class:`~fedddl.defenses.Defenses`.

Override points (a variant overrides one, as Flower's ``FedMedian`` overrides one method
of ``FedAvg``): :meth:`compressor_name`, :meth:`validate_reply`,
:meth:`aggregate_gradients`, :meth:`encode_downlink`. The Flower strategy
:class:`strategies.terngrad.TernGrad` inherits them.

A round with fewer than ``min_replies`` accepted replies applies no update: every
replica keeps its version. Checkpoints (:meth:`checkpoint`, :meth:`restore`) capture the
shadow replica, its optimiser, the version, the log and the downlink state; after a
restore the server knows nothing about the clients, so each node's first message is a
snapshot.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING, getLogger

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedddl.checkpoint import CheckpointError, ServerCheckpoint
from fedddl.compression import (
    EntryHeader,
    OpenedMessage,
    PayloadError,
    ResidualMemory,
    decode_update,
    is_ternary,
)
from fedddl.compression import make_compressor as build_compressor
from fedddl.compression.codecs.downlink import (
    add_statistics,
    decode_broadcast_parts,
    encode_bundle,
    encode_reencoded,
    encode_shared_sum,
)
from fedddl.compression.codecs.wire import decode_small_batch
from fedddl.defenses import Defenses
from fedddl.lr_decay import NO_DECAY, StepDecay
from fedddl.replica import CatchUp, Replica, ReplicaError, UpdateLog, plan_catch_up
from fedddl.running_stats import StatisticsError, check_statistics
from fedddl.seeding import derive_seed
from fedddl.sync import checkpoints
from fedddl.sync.aggregation import Aggregate, Contribution
from fedddl.sync.errors import (
    FingerprintMismatch,
    PayloadRejected,
    ReplyError,
    ResyncRequest,
    UnexpectedReply,
    VersionMismatch,
)
from fedddl.sync.exemptions import WARMUP_COMPRESSOR, exempt_parameters
from fedddl.sync.messages import ClientReply, TrainInstruction, fingerprint_prefix
from fedddl.sync.nodes import NodeBook
from fedddl.sync.report import RoundReport
from fedddl.sync.resync_limit import ResyncLimiter
from fedddl.sync.robust import make_aggregator
from fedddl.sync.scale_bound import ScaleBound
from fedddl.sync.screening import PayloadSpec
from fedddl.sync.statistics_bound import bound_statistics, check_statistics_range

__all__ = ["DOWNLINKS", "ParseFailure", "ReplicaServer"]

DOWNLINKS: tuple[str, ...] = ("reternarize", "shared-scale-sum")

logger = getLogger("fedddl")

#: Float32 bytes of small models' replies decoded at once (:meth:`ReplicaServer._decoded`).
BATCH_DECODE_BYTES = 4 << 20


@dataclass(frozen=True)
class ParseFailure:
    """A reply that could not even be parsed (error reply, missing or malformed records)."""

    node_id: int
    error: ReplyError


def _combination_key(reply: ClientReply) -> tuple[int, int, int]:
    """The order in which accepted replies are combined: by the partition each client
    reports, node id last (replies without a partition after the others). Float sums depend
    on their order; neither arrival order nor node ids (which Flower's simulation draws at
    random for every run) are the same from one run to the next, partitions are. A client
    that lies about its partition only moves its own reply in the sum."""
    if reply.partition_id is None:
        return (1, 0, reply.node_id)
    return (0, reply.partition_id, reply.node_id)


@dataclass(frozen=True)
class _Screened:
    """A reply that passed screening: its payload's entries, the tensors to clip (tensor →
    bound) and its checked BatchNorm statistics."""

    reply: ClientReply
    message: OpenedMessage
    clip: dict[str, float]
    statistics: dict[str, torch.Tensor] | None = None

    @property
    def entries(self) -> list[EntryHeader]:
        """The payload's entries, in message order."""
        return self.message.entries


class ReplicaServer:
    """Versioned shadow replica, catch-up planning, reply checks, aggregation, downlink.

    Parameters
    ----------
    model_fn : Callable[[], torch.nn.Module]
        Builds the seeded initial model (identical to what every client builds).
    learning_rate, momentum : float
        The shared SGD optimiser applied by every replica.
    compressor : str
        Registered uplink compressor name (also used to re-encode the downlink).
    clip_sigma : float
        Clipping passed to compressors with the ``ternary`` capability.
    downlink : str
        ``"reternarize"`` or ``"shared-scale-sum"``.
    update_log_size : int
        Broadcast updates kept for catch-up; further behind gets a snapshot.
    seed : int
        Seeds the server-side compressor (and, in the Flower strategy, node sampling).
    min_replies : int
        Accepted replies needed to apply a round's update (fewer: the round is skipped).
    fp32_min_numel, fp32_logits, fp32_warmup_rounds
        TernGrad's fp32 exemptions (:mod:`fedddl.sync.exemptions`), both directions.
    defenses : Defenses | None
        Aggregator, scale bound and resync rate limit (None: the defaults).

    Attributes
    ----------
    shadow : Replica
        The server's replica; what the clients' replicas equal at the same version.
    log : UpdateLog
        Encoded broadcast updates, by the version they produce.
    nodes : NodeBook
        What the server knows about each node's replica.
    reports : list[RoundReport]
        One report per aggregated round.
    round_offset : int
        Rounds completed before a restore (added to the caller's round numbers).
    scale_bound : ScaleBound
        The header scale bound and its history.
    resyncs : ResyncLimiter
        The resync rate limit.
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        *,
        learning_rate: float = 0.1,
        momentum: float = 0.9,
        lr_decay: StepDecay = NO_DECAY,
        compressor: str = "ternary",
        clip_sigma: float = 2.5,
        downlink: str = "reternarize",
        update_log_size: int = 8,
        seed: int = 0,
        min_replies: int = 1,
        fp32_min_numel: int = 0,
        fp32_logits: bool = False,
        fp32_warmup_rounds: int = 0,
        defenses: Defenses | None = None,
    ) -> None:
        if downlink not in DOWNLINKS:
            raise ValueError(
                f"downlink must be 'reternarize' or 'shared-scale-sum', got {downlink!r}"
            )
        if min_replies < 1:
            raise ValueError(f"min_replies must be >= 1, got {min_replies}")
        if fp32_warmup_rounds < 0:
            raise ValueError(f"fp32_warmup_rounds must be >= 0, got {fp32_warmup_rounds}")
        self._compressor_arg = compressor
        self.clip_sigma = clip_sigma
        self.downlink = downlink
        self.seed = seed
        self.min_replies = min_replies
        self.round_offset = 0
        build_compressor(self.compressor_name(), seed=0, clip_sigma=clip_sigma)  # validates
        self.defenses = defenses if defenses is not None else Defenses()
        self._aggregator = make_aggregator(
            self.defenses.aggregator, trim_fraction=self.defenses.trim_fraction
        )
        self.scale_bound = self._new_scale_bound()
        self.resyncs = ResyncLimiter(self.defenses.resync_interval)
        self._limited: list[int] = []
        self.shadow = Replica(model_fn(), learning_rate, momentum, version=0, lr_decay=lr_decay)
        self._specs: dict[str, PayloadSpec] = {}
        self.param_names = [n for n, p in self.shadow.model.named_parameters() if p.requires_grad]
        self.dense = exempt_parameters(
            self.shadow.model, min_numel=fp32_min_numel, logits=fp32_logits
        )
        self.fp32_warmup_rounds = fp32_warmup_rounds
        self._scratch: dict[str, torch.Tensor] | None = None
        self._round = 0
        self.log = UpdateLog(update_log_size)
        self.fingerprints: OrderedDict[int, str] = OrderedDict({0: self.shadow.fingerprint()})
        self.nodes = NodeBook()
        self.server_memory = ResidualMemory()
        self.shared_scales: torch.Tensor | None = None
        self.reports: list[RoundReport] = []

    # ------------------------------------------------------------ override points
    def compressor_name(self) -> str:
        """Override point: the uplink compressor clients use (and the server re-encodes with)."""
        return self._compressor_arg

    def validate_reply(self, reply: ClientReply, expected_version: int | None) -> None:
        """Override point: check one parsed reply against the round, before any decoding.

        Parameters
        ----------
        reply : ClientReply
            The parsed reply.
        expected_version : int | None
            The version the node was told to reach (None: it was not asked this round, or
            already replied).

        Raises
        ------
        ReplyError
            A subclass naming the reason (:mod:`fedddl.sync.errors`); the server learns
            about the node from the class.
        """
        node = reply.node_id
        if expected_version is None:
            raise UnexpectedReply(
                f"node {node} was not sent a message this round or already replied"
            )
        if reply.resync:
            raise ResyncRequest(f"node {node} asks to resync from version {reply.model_version}")
        if reply.model_version != expected_version:
            raise VersionMismatch(
                f"node {node} is at version {reply.model_version}, expected {expected_version}"
            )
        want = self.fingerprints.get(expected_version)
        if want is not None and reply.fingerprint != fingerprint_prefix(want).hex():
            raise FingerprintMismatch(
                f"node {node} fingerprint mismatch at version {expected_version}"
            )

    def aggregate_gradients(self, contributions: Iterable[Contribution]) -> Aggregate:
        """Override point: combine the round's accepted gradients.

        Default: the configured aggregator (``defenses.aggregator``, see
        :mod:`fedddl.sync.robust`; ``"mean"`` streams). ``contributions`` yields the
        accepted replies one at a time, each decoded into a buffer that the next one
        overwrites (copy what you keep). Replies whose payload fails to decode are dropped
        before they are yielded. An exception raised here skips the round (logged).
        """
        return self._aggregator(contributions, self._code_scales())

    def encode_downlink(self, server_round: int, aggregate: Aggregate) -> tuple[bytes, str]:
        """Override point: the broadcast bytes of this round's aggregate, and their format.

        Default: the exact shared-scale sum of the ternary codes when it applies (see
        :mod:`fedddl.compression.downlink`), else the aggregate re-encoded with the uplink
        compressor and server-side error feedback. The bytes must decode with
        :func:`~fedddl.compression.downlink.decode_broadcast`.
        """
        if aggregate.code_sums is not None and self.shared_scales is not None:
            ternary = [n for n in self.param_names if n not in self.dense]
            scales = dict(zip(self.param_names, self.shared_scales.tolist(), strict=True))
            sums = {n: aggregate.code_sums[n] for n in ternary}
            shapes = {n: tuple(aggregate.gradient[n].shape) for n in ternary}
            count = len(aggregate.contributors)
            exact = encode_shared_sum(sums, {n: scales[n] for n in ternary}, shapes, count)
            dense = {n: aggregate.gradient[n] for n in self.param_names if n in self.dense}
            return encode_bundle(exact, dense), "shared-scale-sum"
        compressor = build_compressor(
            self.compressor_for(server_round),
            seed=derive_seed(self.seed, server_round, 1 << 40),
            clip_sigma=self.clip_sigma,
        )
        payload = encode_reencoded(
            aggregate.gradient, compressor, self.server_memory, dense=self.dense
        )
        return payload, "encoded"

    # ------------------------------------------------------------------ rounds
    @property
    def last_report(self) -> RoundReport | None:
        """The report of the latest aggregated round."""
        return self.reports[-1] if self.reports else None

    def compressor_for(self, server_round: int) -> str:
        """The uplink compressor of (global) round ``server_round``: fp32 during warm-up."""
        if server_round <= self.fp32_warmup_rounds:
            return WARMUP_COMPRESSOR
        return self.compressor_name()

    def wants_shared_sum(self, server_round: int) -> bool:
        """Whether clients report local scales for the ``shared-scale-sum`` downlink."""
        name = self.compressor_for(server_round)
        return self.downlink == "shared-scale-sum" and is_ternary(name)

    def plan_round(self, server_round: int, nodes: Iterable[int]) -> dict[int, TrainInstruction]:
        """Return the instruction of every node of this (global) round.

        Nodes in the same situation get the same instruction object, so a transport can
        serialize it once.
        """
        current = self.shadow.version
        snapshot: dict[str, torch.Tensor] | None = None
        shared: dict[tuple[str, int, bool], TrainInstruction] = {}
        want_scales = self.wants_shared_sum(server_round)
        compressor = self.compressor_for(server_round)
        plan: dict[int, TrainInstruction] = {}
        limited: list[int] = []
        for node in nodes:
            known = self.nodes.known_version(node)
            catch_up = plan_catch_up(known, current, self.log)
            if _costly(catch_up):
                if self.resyncs.holds_back(node, server_round):
                    known, catch_up = self._usual_catch_up(current)
                    limited.append(node)
                else:
                    self.resyncs.served(node, server_round)
            tell = self.nodes.needs_compressor(node, compressor) or catch_up.kind == "snapshot"
            key = (catch_up.kind, known if catch_up.kind == "log" else -2, tell)
            instruction = shared.get(key)
            if instruction is None:
                if catch_up.kind == "snapshot" and snapshot is None:
                    snapshot = self.shadow.snapshot()
                instruction = TrainInstruction(
                    server_round=server_round,
                    model_version=current,
                    updates=catch_up.updates,
                    snapshot=snapshot if catch_up.kind == "snapshot" else None,
                    snapshot_version=current if catch_up.kind == "snapshot" else -1,
                    compressor=compressor if tell else None,
                    scales=self.shared_scales if want_scales else None,
                    want_scales=want_scales,
                )
                shared[key] = instruction
            self.nodes.sent(node, current, compressor)
            plan[node] = instruction
        self._limited = limited
        return plan

    def _usual_catch_up(self, current: int) -> tuple[int, CatchUp]:
        """What a node one version behind gets: the latest logged update (or nothing)."""
        if current >= 1:
            usual = plan_catch_up(current - 1, current, self.log)
            if usual.kind == "log":
                return current - 1, usual
        return current, CatchUp("none", [])

    def aggregate(
        self, server_round: int, replies: Iterable[ClientReply | ParseFailure]
    ) -> RoundReport:
        """Check, combine and apply this (global) round's replies; return its report."""
        start = time.perf_counter()
        report = RoundReport(server_round)
        report.resync_limited, self._limited = self._limited, []
        self._round = server_round
        screened = [r for r in (self._screen(item, report) for item in replies) if r is not None]
        self.nodes.end_round()
        # Combined in partition order, not arrival order: float sums depend on their order,
        # and the same seed must give the same model however the replies raced and whatever
        # ids the nodes drew (Flower's simulation draws new random node ids every run).
        bounded = sorted(
            self._bound_scales(screened, report), key=lambda s: _combination_key(s.reply)
        )
        failure = ""
        try:
            aggregate = self.aggregate_gradients(self._decoded(bounded, report))
        except Exception as err:  # e.g. a robust aggregator's bug on hostile input
            aggregate = Aggregate({})
            failure = f"aggregation failed: {type(err).__name__}: {err}"
        report.accepted = sorted(r.node_id for r in aggregate.contributors)
        if aggregate.contributors:
            report.loss = sum(r.loss for r in aggregate.contributors) / len(aggregate.contributors)
        if failure:
            pass
        elif not aggregate.contributors:
            report.skip_reason = "no valid reply"
            logger.log(WARNING, "round %d has no valid reply, no update", server_round)
        elif len(aggregate.contributors) < self.min_replies:
            report.skip_reason = (
                f"{len(aggregate.contributors)} valid replies, need {self.min_replies}"
            )
            logger.log(
                WARNING,
                "round %d skipped: %d valid replies, need %d; no update applied, "
                "model version stays %d",
                server_round,
                len(aggregate.contributors),
                self.min_replies,
                self.shadow.version,
            )
        else:
            failure = self._apply_or_explain(server_round, aggregate, report)
        if failure:
            report.skip_reason = failure
            logger.log(
                WARNING,
                "round %d skipped: %s; no update applied, model version stays %d",
                server_round,
                failure,
                self.shadow.version,
            )
        report.skipped = bool(report.skip_reason)
        report.version = self.shadow.version
        report.aggregate_s = time.perf_counter() - start
        self.reports.append(report)
        logger.log(
            INFO,
            "round %d: %d accepted, %d dropped, version %d, replicas equal: %s",
            server_round,
            len(report.accepted),
            len(report.dropped),
            report.version,
            report.replicas_equal,
        )
        return report

    def _screen(self, item: ClientReply | ParseFailure, report: RoundReport) -> _Screened | None:
        """Validate one reply and its payload header; record a drop and return None if it fails.

        No gradient value is decoded here (only the small BatchNorm statistics, bounded in
        size first). Any exception counts against the reply, never the round.
        """
        if isinstance(item, ParseFailure):
            self.resyncs.unreadable(item.node_id)
            self._drop(report, item.node_id, item.error)
            return None
        error: ReplyError | None = None
        message: OpenedMessage | None = None
        statistics: dict[str, torch.Tensor] | None = None
        try:
            self.validate_reply(item, self.nodes.expected_version(item.node_id))
            message = self._check_payload(item)
            statistics = self._statistics_of(item)
        except ReplyError as err:
            error = err
        except Exception as err:  # a bug in an override on hostile input must not end the round
            error = PayloadRejected(
                f"node {item.node_id} reply rejected: {type(err).__name__}: {err}"
            )
        self.nodes.learn(item, error)
        self.resyncs.learn(item.node_id, error)
        if error is not None:
            self._drop(report, item.node_id, error)
            return None
        assert message is not None  # _check_payload returned
        report.note_fingerprint_checked(item.node_id)
        return _Screened(item, message, {}, statistics)

    def _check_payload(self, reply: ClientReply) -> OpenedMessage:
        """The payload, its header checked against the model (and the reply's local scales)."""
        if reply.payload is None:
            raise PayloadRejected(f"node {reply.node_id} payload rejected: no payload")
        message = self._payload_spec().check(reply.payload, reply.node_id)
        size = (len(self.param_names),)
        if (
            reply.scales is not None
            and self.wants_shared_sum(self._round)
            and reply.scales.shape != size
        ):
            raise PayloadRejected(
                f"node {reply.node_id} payload rejected: {tuple(reply.scales.shape)} local "
                f"scales for {len(self.param_names)} tensors"
            )
        return message

    def _payload_spec(self) -> PayloadSpec:
        """What this round's replies must look like (the round's compressor, the exemptions)."""
        name = self.compressor_for(self._round)
        spec = self._specs.get(name)
        if spec is None:
            compressor = build_compressor(name, seed=0, clip_sigma=self.clip_sigma)
            spec = PayloadSpec.for_model(self.shadow.model, compressor, dense=self.dense)
            self._specs[name] = spec
        return spec

    def _bound_scales(self, screened: list[_Screened], report: RoundReport) -> list[_Screened]:
        """Apply the scale bound (and the statistics bound): note the clipped replies, drop
        the dropped ones."""
        verdict = self.scale_bound.screen(
            {item.reply.node_id: item.entries for item in screened}, self._code_scales()
        )
        for node, why in verdict.dropped.items():
            self._drop(report, node, PayloadRejected(why))
        kept = [item for item in screened if item.reply.node_id not in verdict.dropped]
        clipped = dict(verdict.clipped)
        if self.scale_bound.enabled:
            stats = {i.reply.node_id: i.statistics for i in kept if i.statistics is not None}
            for node, why in bound_statistics(stats, self.scale_bound.factor).items():
                clipped[node] = f"{clipped[node]}; {why}" if node in clipped else why
        for node, why in clipped.items():
            report.clipped[node] = why
            logger.log(WARNING, "clipping reply: %s", why)
        return [
            _Screened(item.reply, item.message, verdict.clip.get(item.reply.node_id, {}),
                      item.statistics)
            for item in kept
        ]  # fmt: skip

    def _decoded(self, screened: list[_Screened], report: RoundReport) -> Iterator[Contribution]:
        """Decode each screened reply into one reused buffer; drop those that do not decode.

        Server memory therefore stays flat in the number of clients: the encoded replies,
        one fp32 decode buffer and the aggregation's accumulator. Small models' replies
        (where each reply's decoding steps cost more than its values) are decoded in
        batches of at most :data:`BATCH_DECODE_BYTES` of float32 values
        (:func:`~fedddl.compression.wire.decode_small_batch`: the same values; a batch
        with any reply it does not apply to is decoded reply by reply, as before).
        """
        scratch = self._decode_buffers()
        numel = sum(t.numel() for t in scratch.values())
        per_batch = max(1, BATCH_DECODE_BYTES // max(1, 4 * numel))
        for first in range(0, len(screened), per_batch):
            chunk = screened[first : first + per_batch]
            try:
                batch = decode_small_batch([item.message for item in chunk], scratch)
            except Exception:  # a decoder bug on hostile input: one by one, which blames one
                batch = None
            for position, item in enumerate(chunk):
                decoded = None if batch is None else batch[position]
                contribution = self._contribution(item, scratch, decoded, report)
                if contribution is not None:
                    yield contribution

    def _contribution(
        self,
        item: _Screened,
        scratch: dict[str, torch.Tensor],
        decoded: dict[str, torch.Tensor] | None,
        report: RoundReport,
    ) -> Contribution | None:
        """One screened reply's contribution: its values (``decoded`` already, else decoded
        into ``scratch``), clipped as screening decided and checked; None if dropped."""
        reply = item.reply
        scales = {e.name: e.scale for e in item.entries if e.codec is not None}
        peaks = _dense_peaks(item.entries)
        try:
            try:
                values = item.message.decode(out=scratch) if decoded is None else decoded
                for name, bound in item.clip.items():
                    if name in scales:
                        scales[name] = _clip_ternary(values[name], bound)
                    else:  # a dense (fp32-exempt) tensor: its values, to +-bound
                        values[name].clamp_(-bound, bound)
                        if name in peaks:
                            peaks[name] = min(peaks[name], bound)
                unvouched = [
                    e.name for e in item.entries if e.name not in scales and e.name not in peaks
                ]
                _check_finite(values, unvouched)
            except (PayloadError, ReplicaError, StatisticsError) as err:
                raise PayloadRejected(f"node {reply.node_id} payload rejected: {err}") from err
            except Exception as err:  # a decoder bug on hostile input must not end the round
                raise PayloadRejected(
                    f"node {reply.node_id} payload rejected: {type(err).__name__}: {err}"
                ) from err
        except PayloadRejected as err:
            self._drop(report, reply.node_id, err)
            return None
        return Contribution(reply, values, scales=scales, statistics=item.statistics, peaks=peaks)

    def _decode_buffers(self) -> dict[str, torch.Tensor]:
        """One float32 CPU buffer per trainable parameter, reused by every reply and round."""
        if self._scratch is None:
            self._scratch = {
                n: torch.zeros(p.shape, dtype=torch.float32)
                for n, p in self.shadow.model.named_parameters()
                if p.requires_grad
            }
        return self._scratch

    def _statistics_of(self, reply: ClientReply) -> dict[str, torch.Tensor] | None:
        """The reply's BatchNorm statistics, checked against the model and the limits of
        :mod:`fedddl.sync.statistics_bound` (None: no BatchNorm).

        Raises
        ------
        PayloadRejected
            Naming what is wrong with them.
        """
        what = f"node {reply.node_id} statistics rejected"
        layers = self.shadow.batchnorm
        if not layers:
            if reply.statistics is not None:
                raise PayloadRejected(f"{what}: the model has no BatchNorm layer")
            return None
        if reply.statistics is None:
            raise PayloadRejected(f"{what}: the model has BatchNorm layers but none came")
        try:
            statistics = decode_update(
                reply.statistics,
                max_bytes=_statistics_max_bytes(layers),
                max_tensors=3 * len(layers),
            )
            check_statistics(self.shadow.model, statistics, layers=layers)
            check_statistics_range(statistics)
        except (PayloadError, StatisticsError) as err:
            raise PayloadRejected(f"{what}: {err}") from err
        return statistics

    def _drop(self, report: RoundReport, node: int, error: ReplyError) -> None:
        report.dropped[node] = str(error)
        if isinstance(error, FingerprintMismatch):
            report.note_fingerprint_checked(node, mismatch=True)
        logger.log(WARNING, "dropping reply: %s", error)

    def _apply_or_explain(
        self, server_round: int, aggregate: Aggregate, report: RoundReport
    ) -> str:
        """Apply the aggregate; on failure change nothing and return why ('' on success)."""
        saved = self.server_memory.save()
        try:
            self._apply(server_round, aggregate, report)
        except Exception as err:  # hostile values that reached the aggregate: skip the round
            self.server_memory.restore(saved)
            report.downlink_format = "none"
            return f"the aggregate could not be encoded or applied: {type(err).__name__}: {err}"
        return ""

    def _apply(self, server_round: int, aggregate: Aggregate, report: RoundReport) -> None:
        """Encode, decode, apply and log the aggregate; raises before changing the shadow."""
        payload, report.downlink_format = self.encode_downlink(server_round, aggregate)
        payload = add_statistics(payload, aggregate.statistics)
        # what every client will apply, decoded into the reply buffers (free by now; the
        # replica copies what it applies)
        update, statistics = decode_broadcast_parts(payload, out=self._decode_buffers())
        self.shadow.apply_update(update, self.shadow.version + 1, statistics)
        self.log.append(self.shadow.version, payload)
        self.fingerprints[self.shadow.version] = self.shadow.fingerprint()
        while len(self.fingerprints) > max(64, 2 * len(self.log) + 2):
            self.fingerprints.popitem(last=False)
        if self.wants_shared_sum(server_round + 1):
            self._update_shared_scales(aggregate.contributors)
        else:
            self.shared_scales = None

    def _code_scales(self) -> dict[str, float] | None:
        """The shared scales of the ternary-coded tensors, when the shared sum applies."""
        if not self.wants_shared_sum(self._round) or self.shared_scales is None:
            return None
        pairs = zip(self.param_names, self.shared_scales.tolist(), strict=True)
        return {n: s for n, s in pairs if n not in self.dense}

    def _update_shared_scales(self, contributors: list[ClientReply]) -> None:
        """The next round's shared scales: per tensor, the largest reported local scale,
        but at most ``scale_bound ×`` the lower median of the reported ones (so one client
        cannot set everyone's scale)."""
        size = (len(self.param_names),)
        reported = [
            r.scales.to(torch.float32)
            for r in contributors
            if r.scales is not None and tuple(r.scales.shape) == size
        ]
        if not reported:
            self.shared_scales = None
            return
        stacked = torch.stack(reported)
        shared = stacked.max(dim=0).values
        if self.scale_bound.enabled:
            median = stacked.sort(dim=0).values[(len(reported) - 1) // 2]
            shared = torch.minimum(shared, median * self.scale_bound.factor)
        self.shared_scales = shared

    # ------------------------------------------------------------- checkpoints
    def checkpoint(self, server_round: int, config: dict[str, object]) -> ServerCheckpoint:
        """Capture the server state after global round ``server_round`` (config: the run's)."""
        return checkpoints.capture(
            self.shadow,
            self.log,
            self.server_memory,
            self.shared_scales,
            server_round=server_round,
            config=config,
            owner=self._class_name(),
            extra={"scale_bound": self.scale_bound.state()},
        )

    def restore(self, ckpt: ServerCheckpoint) -> None:
        """Continue from ``ckpt``: shadow replica, optimiser, version, log, downlink state.

        Raises
        ------
        CheckpointError
            If the checkpoint does not fit this server's model or optimiser; nothing is
            changed then.
        """
        restored = checkpoints.load(
            ckpt, self.shadow, self.log.capacity, self._class_name(), self.param_names
        )
        bound = self._new_scale_bound()
        saved_bound = ckpt.strategy_state.get("scale_bound")
        if saved_bound is not None:
            if not isinstance(saved_bound, dict):
                raise CheckpointError("checkpoint scale_bound state must be a dict")
            try:
                bound.load_state(saved_bound)
            except ValueError as err:
                raise CheckpointError(f"checkpoint scale_bound state: {err}") from err
        self.scale_bound = bound
        self.shadow = restored.shadow
        self.log = restored.log
        self.server_memory = restored.memory
        self.shared_scales = restored.shared_scales
        self.round_offset = ckpt.round
        self.fingerprints = OrderedDict({self.shadow.version: self.shadow.fingerprint()})
        self.nodes.forget(unknown_version=-1)  # every node's first message: a snapshot
        self.resyncs.forget()
        rng = (ckpt.rng_states or {}).get("torch")
        if isinstance(rng, torch.Tensor):
            torch.set_rng_state(rng)
        logger.log(
            INFO,
            "restored from checkpoint: round %d, version %d, %d logged updates",
            ckpt.round,
            ckpt.version,
            len(self.log),
        )

    def _new_scale_bound(self) -> ScaleBound:
        d = self.defenses
        return ScaleBound(d.scale_bound, d.scale_bound_action, d.scale_bound_rounds)

    def _class_name(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(compressor={self.compressor_name()!r}, "
            f"downlink={self.downlink!r}, version={self.shadow.version})"
        )


def _statistics_max_bytes(layers: Mapping[str, _BatchNorm]) -> int:
    """Largest acceptable BatchNorm statistics message: per layer three entries (name,
    header of at most 32 bytes) holding ``2 × channels + 1`` values of at most 8 bytes."""
    return 64 + sum(
        3 * (len(name.encode("utf-8")) + 8 + 32) + 8 * (2 * module.num_features + 1)
        for name, module in layers.items()
    )


def _costly(catch_up: CatchUp) -> bool:
    """A resync: a snapshot, or a replay of more than one update."""
    return catch_up.kind == "snapshot" or (catch_up.kind == "log" and len(catch_up.updates) > 1)


def _check_finite(decoded: dict[str, torch.Tensor], unvouched: list[str]) -> None:
    """Reject non-finite values in the ``unvouched`` tensors of float32 ``decoded``.

    Screening vouches for the others: a ternary entry decodes to ``{-1, 0, 1} ×`` its finite
    float32 scale, and a dense entry with a measured peak (:func:`_dense_peaks`) stays
    finite in float32.

    Raises
    ------
    ReplicaError
        Naming the first tensor with a non-finite value.
    """
    for name in unvouched:
        if not bool(torch.isfinite(decoded[name]).all()):
            raise ReplicaError(f"update {name!r} has non-finite values")


def _dense_peaks(entries: list[EntryHeader]) -> dict[str, float]:
    """The measured largest magnitudes of the dense entries whose float32 decoding keeps
    them: float32 / float16 / bfloat16 (float64 values are rounded to float32, which can
    raise a magnitude, or overflow it; a dense entry without a peak was not measured)."""
    return {
        e.name: e.peak
        for e in entries
        if e.codec is None and e.peak is not None and e.dtype != torch.float64
    }


def _clip_ternary(values: torch.Tensor, bound: float) -> float:
    """Make decoded ternary ``values`` exactly ``bound × code`` (in place); return the scale."""
    scale = float(np.float32(bound))
    with torch.no_grad():
        torch.sign(values, out=values)
        values.mul_(scale)
    return scale
