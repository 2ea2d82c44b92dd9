"""The server side of the localized-replica protocol, without Flower, composed of parts.

:class:`ReplicaServer` runs each round through a catch-up planner (:mod:`~.catch_up`),
reply admission (:mod:`~.admission`), aggregation and downlink (:mod:`~.broadcast`) and the
shadow replica with its checkpoints (:mod:`~.shadow`; with ``downlink = "grid"`` the
grid shadow of :mod:`~.grid_shadow`, which applies momentum itself and checkpoints through
:mod:`~.grid_checkpoints`, and the broadcast encoder is not used). Its override points
(:class:`~fedddl.sync.hooks.ServerHooks`) are looked up on ``hooks`` (default: itself) at
each use. Client input never ends the server: a bad reply is dropped with its reason; a
round that cannot be combined, encoded or applied, or has fewer than ``min_replies``
admitted replies, applies no update.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from logging import INFO, WARNING, getLogger

import torch
from torch import nn

from fedddl.checkpoint import ServerCheckpoint
from fedddl.compression import is_ternary, takes_scale_bucket
from fedddl.compression import make_compressor as build_compressor
from fedddl.compression.codecs.downlink import TAG_BUNDLE, add_statistics
from fedddl.defenses import Defenses
from fedddl.lr_decay import NO_DECAY, StepDecay
from fedddl.replica import Replica, UpdateLog
from fedddl.scale_bucket_choice import AUTO as AUTO_BUCKET
from fedddl.scale_bucket_choice import resolve_scale_bucket
from fedddl.sync.admission import ReplyAdmission, drop
from fedddl.sync.aggregation import Aggregate, Contribution
from fedddl.sync.broadcast import Broadcast
from fedddl.sync.catch_up import CatchUpPlanner
from fedddl.sync.checkpoints import load_scale_bound
from fedddl.sync.direction import DirectionCheck
from fedddl.sync.errors import OpposedDirection
from fedddl.sync.exemptions import WARMUP_COMPRESSOR, exempt_parameters
from fedddl.sync.grid_log import GridLog
from fedddl.sync.grid_replica import GridReplica
from fedddl.sync.grid_shadow import GridShadow
from fedddl.sync.hooks import ServerHooks
from fedddl.sync.messages import ClientReply, ParseFailure, TrainInstruction
from fedddl.sync.nodes import NodeBook
from fedddl.sync.norm_clip import NormClip
from fedddl.sync.reply_checks import RoundRules, check_versions
from fedddl.sync.report import RoundReport
from fedddl.sync.scale_bound import ScaleBound
from fedddl.sync.shadow import ShadowReplica

__all__ = [
    "DEFAULT_COMPRESSOR",
    "DEFAULT_GRID_LEVELS",
    "DEFAULT_GRID_LOG_SIZE",
    "DOWNLINKS",
    "ParseFailure",
    "ReplicaServer",
    "ServerHooks",
]

DOWNLINKS: tuple[str, ...] = ("reternarize", "shared-scale-sum", "grid")
#: Codes a round of the ``grid`` downlink may use per value, ``[-L, L]``.
DEFAULT_GRID_LEVELS = 1
#: Rounds of grid updates the server keeps for catch-ups (the ``grid`` downlink).
DEFAULT_GRID_LOG_SIZE = 256
DEFAULT_COMPRESSOR = "ternary"

logger = getLogger("fedddl")


class ReplicaServer:
    """Runs rounds through its parts; ``model_fn`` builds the seeded initial model (as every
    client does), the other settings are the :class:`~fedddl.app_config.AppConfig` fields
    of the same names (``defenses``: :class:`~fedddl.defenses.Defenses`), ``hooks`` the
    object whose override points are used (default: this server)."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        *,
        learning_rate: float = 0.1,
        momentum: float = 0.9,
        lr_decay: StepDecay = NO_DECAY,
        compressor: str = DEFAULT_COMPRESSOR,
        clip_sigma: float = 2.5,
        downlink: str = "reternarize",
        update_log_size: int = 8,
        seed: int = 0,
        min_replies: int = 1,
        fp32_min_numel: int = 0,
        fp32_logits: bool = False,
        fp32_warmup_rounds: int = 0,
        grid_levels: int = DEFAULT_GRID_LEVELS,
        grid_log_size: int = DEFAULT_GRID_LOG_SIZE,
        defenses: Defenses | None = None,
        hooks: ServerHooks | None = None,
        scale_bucket: int | str = AUTO_BUCKET,
    ) -> None:
        if downlink not in DOWNLINKS:
            hint = " (resolve 'auto': AppConfig.resolved_downlink)" if downlink == "auto" else ""
            raise ValueError(
                f"downlink must be one of {', '.join(DOWNLINKS)}, got {downlink!r}{hint}"
            )
        if min_replies < 1:
            raise ValueError(f"min_replies must be >= 1, got {min_replies}")
        if fp32_warmup_rounds < 0:
            raise ValueError(f"fp32_warmup_rounds must be >= 0, got {fp32_warmup_rounds}")
        self.hooks: ServerHooks = self if hooks is None else hooks
        self.compressor = compressor
        name = self.hooks.compressor_name()
        scale_bucket = resolve_scale_bucket(  # "auto", or refused where it cannot be sent
            scale_bucket,
            downlink=downlink,
            compressor=name,
            compressor_takes_buckets=takes_scale_bucket(name),
        )
        self.clip_sigma = clip_sigma
        self.downlink = downlink
        self.seed = seed
        self.min_replies = min_replies
        self.fp32_warmup_rounds = fp32_warmup_rounds
        self.round_offset = 0
        self.scale_bucket: int = scale_bucket
        build_compressor(  # validates
            name, seed=0, clip_sigma=clip_sigma, scale_bucket=scale_bucket
        )
        self.defenses = defenses if defenses is not None else Defenses()
        self.scale_bound = self._new_scale_bound()
        self.direction = DirectionCheck(self.defenses.direction_check)
        # shared-scale-sum: every admitted value is at the server's shared scale already (and
        # the density check bounds the count); a scaled reply would break the exact code sums
        exact_sums = downlink == "shared-scale-sum"
        self.norm_clip = NormClip(0.0 if exact_sums else self.defenses.norm_clip)
        self.replica: ShadowReplica | GridShadow
        if downlink == "grid":
            self.replica = GridShadow(
                model_fn(),
                learning_rate=learning_rate,
                momentum=momentum,
                lr_decay=lr_decay,
                levels=grid_levels,
                seed=seed,
                log_size=grid_log_size,
            )
        else:
            shadow = Replica(model_fn(), learning_rate, momentum, version=0, lr_decay=lr_decay)
            self.replica = ShadowReplica(shadow, update_log_size)
        # the uplink's fp32 exemptions (the grid downlink puts every parameter on the grid)
        model = self.replica.replica.model
        self.dense = exempt_parameters(model, min_numel=fp32_min_numel, logits=fp32_logits)
        self.planner = CatchUpPlanner(self.defenses.resync_interval)
        self.admission = ReplyAdmission(self.planner.nodes, self.planner.resyncs)
        names = self.replica.param_names
        self.broadcast = Broadcast(
            names, self.dense, seed, clip_sigma, self.defenses, scale_bucket=scale_bucket
        )
        self._round = 0
        self.reports: list[RoundReport] = []

    # ------------------------------------------------------------ override points
    def compressor_name(self) -> str:
        """Override point: the uplink compressor clients use (and the server re-encodes with)."""
        return self.compressor

    def validate_reply(self, reply: ClientReply, expected_version: int | None) -> None:
        """Override point: raise a ``ReplyError`` subclass if the reply does not fit the round
        (default: :func:`~fedddl.sync.reply_checks.check_versions`)."""
        check_versions(reply, expected_version, self.fingerprints)

    def aggregate_gradients(self, contributions: Iterable[Contribution]) -> Aggregate:
        """Override point: the configured aggregator (:mod:`fedddl.sync.robust`)."""
        return self.broadcast.combine(contributions, self._code_scales())

    def encode_downlink(self, server_round: int, aggregate: Aggregate) -> tuple[bytes, str]:
        """Override point: the broadcast bytes of :mod:`fedddl.compression.codecs.downlink`,
        the pooled statistics included (a bare ``E``/``S`` gradient gets them added), and
        their format."""
        return self.broadcast.encode(server_round, aggregate, self.compressor_for(server_round))

    # -------------------------------------------------------------- the parts' state
    @property
    def shadow(self) -> Replica | GridReplica:
        """The server's replica; what the clients' replicas equal at the same version."""
        return self.replica.replica

    @property
    def log(self) -> UpdateLog | GridLog:
        """Encoded broadcast updates, by the version they produce (grid: the grid updates)."""
        return self.replica.log

    @property
    def fingerprints(self) -> OrderedDict[int, str]:
        """Fingerprints of recent versions."""
        return self.replica.fingerprints

    @property
    def nodes(self) -> NodeBook:
        """What the server knows about each node's replica."""
        return self.planner.nodes

    @property
    def shared_scales(self) -> torch.Tensor | None:
        """The next round's shared scales (shared-scale-sum downlink)."""
        return self.broadcast.shared_scales

    @property
    def last_report(self) -> RoundReport | None:
        """The report of the latest aggregated round."""
        return self.reports[-1] if self.reports else None

    # ------------------------------------------------------------------ rounds
    def compressor_for(self, server_round: int) -> str:
        """The uplink compressor of (global) round ``server_round``: fp32 during warm-up."""
        if server_round <= self.fp32_warmup_rounds:
            return WARMUP_COMPRESSOR
        return self.hooks.compressor_name()

    def wants_shared_sum(self, server_round: int) -> bool:
        """Whether clients report local scales for the ``shared-scale-sum`` downlink."""
        name = self.compressor_for(server_round)
        return self.downlink == "shared-scale-sum" and is_ternary(name)

    def plan_round(self, server_round: int, nodes: Iterable[int]) -> dict[int, TrainInstruction]:
        """The instruction of every node of this (global) round (see :mod:`catch_up`)."""
        compressor, scales = self.compressor_for(server_round), self.shared_scales
        want = self.wants_shared_sum(server_round)
        return self.planner.plan(server_round, nodes, self.replica, compressor, scales, want)

    def aggregate(
        self, server_round: int, replies: Iterable[ClientReply | ParseFailure]
    ) -> RoundReport:
        """Admit, combine and apply this (global) round's replies; return its report."""
        start = time.perf_counter()
        report = RoundReport(server_round)
        report.resync_limited = self.planner.take_limited()
        self._round = server_round
        admitted = self.admission.screen(replies, self._rules(server_round), report)
        failure = ""
        try:
            decoded = self.admission.decoded(admitted, self.replica.buffers(), report)
            directed = self.direction.filter(decoded)
            clipped = self.norm_clip.filter(directed, copied=self.direction.enabled)
            aggregate = self.hooks.aggregate_gradients(clipped)
        except Exception as err:  # e.g. a robust aggregator's bug on hostile input
            aggregate = Aggregate({})
            failure = f"aggregation failed: {type(err).__name__}: {err}"
        for verdict in self.direction.verdicts:
            if verdict.reason:
                level = self.direction.log_level(verdict.node_id)
                drop(report, verdict.node_id, OpposedDirection(verdict.reason), level)
        for node, why in self.norm_clip.clipped.items():
            old = report.clipped.get(node)
            report.clipped[node] = why if old is None else f"{old}; {why}"
            logger.log(self.norm_clip.log_level(node), "clipping reply: %s", why)
        contributors = aggregate.contributors
        report.accepted = sorted(r.node_id for r in contributors)
        if contributors:
            report.loss = sum(r.loss for r in contributors) / len(contributors)
        if not failure and not contributors:
            report.skip_reason = "no valid reply"
            logger.log(WARNING, "round %d has no valid reply, no update", server_round)
        elif not failure and len(contributors) < self.min_replies:
            failure = f"{len(contributors)} valid replies, need {self.min_replies}"
        elif not failure:
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

    def _rules(self, server_round: int) -> RoundRules:
        """What this round's replies must satisfy."""
        name = self.compressor_for(server_round)
        return RoundRules(
            validate=self.hooks.validate_reply,
            spec=self.admission.spec(
                name, self.shadow.model, self.clip_sigma, self.dense, self.scale_bucket
            ),
            shared_sum=self.wants_shared_sum(server_round),
            num_tensors=len(self.replica.param_names),
            model=self.shadow.model,
            batchnorm=self.shadow.batchnorm,
            scale_bound=self.scale_bound,
            code_scales=self._code_scales(),
            statistics_bound=self.defenses.statistics_bound,
        )

    def _code_scales(self) -> dict[str, float] | None:
        return self.broadcast.code_scales(self.wants_shared_sum(self._round))

    def _apply_or_explain(
        self, server_round: int, aggregate: Aggregate, report: RoundReport
    ) -> str:
        """Encode, apply and log the aggregate; on failure change nothing and return why."""
        if isinstance(self.replica, GridShadow):
            return self.replica.apply_or_explain(
                aggregate.gradient, aggregate.statistics or {}, report
            )
        saved = self.broadcast.memory.save()
        try:
            payload, report.downlink_format = self.hooks.encode_downlink(server_round, aggregate)
            if aggregate.statistics and payload[:1] != TAG_BUNDLE:  # an override's bare gradient
                payload = add_statistics(payload, aggregate.statistics)
            self.replica.apply(payload)
            if self.wants_shared_sum(server_round + 1):
                self.broadcast.update_shared_scales(aggregate.contributors, self.scale_bound)
            else:
                self.broadcast.shared_scales = None
        except Exception as err:  # hostile values that reached the aggregate: skip the round
            self.broadcast.memory.restore(saved)
            report.downlink_format = "none"
            return f"the aggregate could not be encoded or applied: {type(err).__name__}: {err}"
        return ""

    # ------------------------------------------------------------- checkpoints
    def checkpoint(self, server_round: int, config: dict[str, object]) -> ServerCheckpoint:
        """Capture the server state after global round ``server_round`` (config: the run's)."""
        extra = {"scale_bound": self.scale_bound.state()}
        if isinstance(self.replica, GridShadow):
            return self.replica.checkpoint(
                server_round, config, memory=self.broadcast.memory, owner=self._owner(), extra=extra
            )
        return self.replica.checkpoint(
            server_round,
            config,
            memory=self.broadcast.memory,
            shared_scales=self.shared_scales,
            owner=self._owner(),
            extra=extra,
        )

    def restore(self, ckpt: ServerCheckpoint) -> None:
        """Continue from ``ckpt``; raises ``CheckpointError`` and changes nothing if it does
        not fit. The server then knows no client: each node's first message is a snapshot."""
        if isinstance(self.replica, GridShadow):
            grid = self.replica.load(ckpt, self._owner())
            self.scale_bound = load_scale_bound(ckpt, self._new_scale_bound())
            self.replica.adopt(grid, ckpt)
            memory, scales = grid.memory, None
        else:
            restored = self.replica.load(ckpt, self._owner())
            self.scale_bound = load_scale_bound(ckpt, self._new_scale_bound())
            self.replica.adopt(restored, ckpt)
            memory, scales = restored.memory, restored.shared_scales
        self.broadcast.memory = memory
        self.broadcast.shared_scales = scales
        self.round_offset = ckpt.round
        self.planner.forget()

    def _new_scale_bound(self) -> ScaleBound:
        d = self.defenses
        return ScaleBound(
            d.scale_bound, d.scale_bound_action, d.scale_bound_rounds, d.scale_weight
        )

    def _owner(self) -> str:
        return f"{type(self.hooks).__module__}.{type(self.hooks).__qualname__}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(compressor={self.hooks.compressor_name()!r}, "
            f"downlink={self.downlink!r}, version={self.shadow.version})"
        )
