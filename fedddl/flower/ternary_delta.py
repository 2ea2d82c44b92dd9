"""``TernaryDelta``: a Flower strategy wrapper that sends and receives ternary model deltas.

Wrap any Flower :class:`~flwr.serverapp.strategy.Strategy`; add
:func:`fedddl.flower.ternary_mod` to the ClientApp; nothing else changes::

    from flwr.serverapp.strategy import FedAvg
    from fedddl.flower import TernaryDelta

    strategy = TernaryDelta(FedAvg(fraction_train=0.5))
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)

**Downlink** (:mod:`fedddl.flower.delta_broadcast`). Each new global model moves the
*broadcast model* (what the clients hold) towards it by a quantized step of the whole gap
(what one step could not carry goes with the next). By default (``downlink="grid"``,
:mod:`fedddl.flower.delta_grid`) the broadcast model lives on an integer grid and a node
that has answered once with the mod gets one message of summed integer counts, whatever it
missed; its first message is the whole model. With ``downlink="delta"`` a node that holds a
version still in the log gets the ternary deltas it misses, others the whole model. Resyncs
a node causes are rate-limited (``resync_interval``).

**Uplink.** The mod encodes each reply's model as ``reply - broadcast model`` (with a
client-side residual memory for error feedback); the wrapper decodes it and adds it to
the *exact* global model the wrapped strategy handed out, so the wrapped strategy sees
replies as if the clients had trained from its own model (no downlink error accumulates).

**Untrusted replies.** Compressed replies pass TernGrad's admission pipeline
(:mod:`fedddl.flower.delta_admission`); a plain reply must have the sent model's layout
and finite values. A reply that fails becomes an error reply naming the node and the reason.
An aggregate that is not finite is not adopted. The wrapper never raises on a reply.
Nodes without the mod get the wrapped strategy's messages unchanged after their first
reply, as do messages without a model.

**Dtypes and notices.** Float16/32/64 arrays are compressed whatever dtype the wrapped
strategy returns (uplink deltas in float32, restored in the app's dtype); other arrays
travel exact. Whatever travels plain is logged once per node and reason, and each
exchange's traffic is merged into the wrapped strategy's aggregated metrics
(:mod:`fedddl.flower.delta_traffic`). Details: docs/drop-in-compression.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedddl.flower.delta_admission import (
    DIRECTION_NOISE,
    DeltaAdmission,
    Layout,
    layout_of,
    parse_delta_reply,
)
from fedddl.flower.delta_broadcast import DeltaBroadcast
from fedddl.flower.delta_grid_protocol import GRID
from fedddl.flower.delta_protocol import DELTA, META, UPDATES, UPLINK_DTYPE, join_model
from fedddl.flower.delta_replies import (
    error_reply,
    fault_kind,
    model_key,
    non_finite_array,
    restored,
    without_ours,
)
from fedddl.flower.delta_settings import check_settings
from fedddl.flower.delta_traffic import Traffic, TrafficLog, array_bytes, whole_model_reason
from fedddl.flower.error_feedback_choice import FeedbackWindow, resolve_error_feedback
from fedddl.sync.direction import DirectionCheck
from fedddl.sync.errors import PayloadRejected
from fedddl.sync.messages import ClientReply, ParseFailure
from fedddl.sync.report import RoundReport
from fedddl.sync.scale_bound import ScaleBound

__all__ = ["TernaryDelta"]

_INFO, _WARNING = logging.INFO, logging.WARNING


class TernaryDelta(Strategy):
    """Ternary model deltas up and down around any Flower strategy.

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy (FedAvg, FedProx, a DP wrapper, ...): it samples nodes,
        builds the messages and aggregates as usual.
    compressor : str
        Registered compressor, up and down. The default: five levels a value (7/3 bits)
        with the scale that keeps each delta's length along itself (contractive);
        ``"ternary-threshold-base3"`` takes buckets (docs/results/dropin-accuracy.md).
    clip_sigma : float
        Ternary compressors' clipping, in standard deviations (five levels clip at 2.5 RMS).
    error_feedback : bool or "auto"
        Residual memory on each client for the uplink (what a delta could not carry is
        sent later); the downlink corrects its error by construction. ``"auto"``: on unless
        the wrapped strategy does not average every reply (FedMedian, FedTrimmedAvg, Krum,
        ...: :mod:`fedddl.flower.error_feedback_choice`); resolved in ``.error_feedback``.
    downlink : bool or str
        ``"grid"`` (default): the broadcast model lives on an integer grid and every node
        that answered once with the mod gets one message of summed integer counts, never
        a whole fp32 model (:mod:`fedddl.flower.delta_grid`); ``"delta"`` (or ``True``):
        send ternary deltas of the global model to nodes that hold a recent broadcast,
        the whole model to the others; ``"none"`` (or ``False``): every message carries
        the whole, exact global model.
    update_log_size : int
        Global models' worth of encoded downlink deltas kept for nodes that missed rounds
        (``"delta"``).
    grid_levels, grid_log_size : int
        ``"grid"``: a version's codes lie in ``[-grid_levels, grid_levels]`` (1 to 127; 3
        keeps up with the first rounds); versions kept for catch-ups (1 to 2**20).
    assume_mod : bool
        ``"grid"``: every node runs ``ternary_mod``, so a node's first message is already a
        grid message. By default a node gets the whole model until it has answered once
        with the mod's record (a node without the mod could not read a grid message).
    resync_interval : int
        A node that made the server lose track of what it holds (an error or no reply, a
        refused reply, another version) is resynced at most once every this many rounds,
        doubling while it keeps failing (:class:`~fedddl.sync.resync_limit.ResyncLimiter`;
        0: no limit).
    feedback_warmup_rounds, feedback_until_round : int
        ``error_feedback`` applies to the replies of rounds ``feedback_warmup_rounds + 1``
        to ``feedback_until_round`` (0: to the end); outside them no residual is added or
        kept (:class:`~fedddl.flower.error_feedback_choice.FeedbackWindow`, ``.feedback``;
        why 20: docs/results/dropin-accuracy.md, ninth round).
    threshold_warmup_rounds, warmup_threshold : int, float
        Rounds at the start whose replies' ternary deltas use the cut ``warmup_threshold``
        (in [0, 1], sent in :data:`META`) instead of the compressor's own (a threshold
        ternary one: a compressor without a cut is refused). 0: off.
    downlink_steps : int
        ``"delta"``: ternary deltas that move the broadcast model towards each new global
        model (each one of the gap that remains), that many times a delta message's bytes.
    scale_bound, scale_bound_action, scale_bound_rounds : float, str, int
        The bound on each reply's delta scales (:class:`~fedddl.sync.scale_bound.ScaleBound`:
        ``factor`` × the median of this round's and the last ``rounds`` rounds' scales;
        0: off). A reply over it is dropped by default: clipped, it would still weigh up to
        ``factor`` × an honest reply in the wrapped strategy's mean. Model deltas change
        size as training goes, so only the round's own replies set the median by default.
    seed : int
        Seed of the compressors' stochastic rounding.
    scale_bucket : int
        Scales of the ternary deltas: 0 one per tensor, ``N > 0`` one per bucket of ``N``
        values, -1 one per output channel (sent to the nodes in :data:`META`; not with
        the default compressor).
    direction_check : float
        A compressed reply whose delta's signs agree with the other replies' majority vote
        less than this fraction of the round's median agreement and more than
        ``DIRECTION_NOISE / sqrt(nnz)`` below it (within noise it is kept), or that has more
        than twice the median count of non-zero values, is dropped
        (:mod:`fedddl.sync.direction`, as TernGrad's ``direction-check``); 0: off.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        compressor: str = "quinary-projected-base5",
        clip_sigma: float = 2.5,
        error_feedback: bool | str = "auto",
        downlink: bool | str = "grid",
        update_log_size: int = 4,
        grid_levels: int = 3,
        grid_log_size: int = 64,
        assume_mod: bool = False,
        resync_interval: int = 30,
        scale_bound: float = 8.0,
        scale_bound_action: str = "drop",
        scale_bound_rounds: int = 0,
        seed: int = 0,
        downlink_steps: int = 1,
        feedback_warmup_rounds: int = 0,
        feedback_until_round: int = 20,
        threshold_warmup_rounds: int = 0,
        warmup_threshold: float = 0.35,
        scale_bucket: int = 0,
        direction_check: float = 0.1,
    ) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Flower Strategy, got {type(strategy).__name__}")
        mode = check_settings(
            compressor=compressor, clip_sigma=clip_sigma, downlink=downlink,
            update_log_size=update_log_size, grid_levels=grid_levels,
            grid_log_size=grid_log_size, resync_interval=resync_interval,
            downlink_steps=downlink_steps, threshold_warmup_rounds=threshold_warmup_rounds,
            warmup_threshold=warmup_threshold, scale_bucket=scale_bucket,
        )  # fmt: skip
        self.scale_bucket = scale_bucket
        self.strategy = strategy
        self.compressor = compressor
        self.clip_sigma = float(clip_sigma)
        self.feedback = FeedbackWindow(
            *resolve_error_feedback(error_feedback, strategy),
            feedback_warmup_rounds, feedback_until_round,
        )  # fmt: skip
        self.threshold_warmup_rounds = threshold_warmup_rounds
        self.warmup_threshold = float(warmup_threshold)
        self.downlink = mode
        self.update_log_size = update_log_size
        self.seed = seed
        self.broadcast = DeltaBroadcast(
            compressor, clip_sigma, self.error_feedback, mode, update_log_size, seed,
            grid_levels=grid_levels, grid_log_size=grid_log_size, steps=downlink_steps,
            scale_bucket=scale_bucket,
        )  # fmt: skip
        #: Dropped replies by the kind of error; clipped replies by node; the rounds whose
        #: aggregate was not finite; the last exchange's report.
        self.dropped: dict[str, int] = {}
        self.clipped: dict[int, int] = {}
        self.skipped: list[int] = []
        self.last_report: RoundReport | None = None
        self.admission = DeltaAdmission(
            ScaleBound(scale_bound, scale_bound_action, scale_bound_rounds),
            resync_interval,
            DirectionCheck(direction_check, noise=DIRECTION_NOISE),  # out of range: ValueError
        )
        #: The exchanges' counts, the run's totals and the plain notices.
        self.traffic_log = TrafficLog()
        self._plain: set[int] = set()
        self.assume_mod = assume_mod
        self._modded: set[int] = set()  # nodes that answered with the mod's record
        self._whole: set[int] = set()  # nodes whose last message was the whole model
        self._sent: dict[int, tuple[Message, str, Layout]] = {}

    @property
    def error_feedback(self) -> bool:
        """Whether the uplink uses error feedback at all (``error_feedback`` resolved)."""
        return self.feedback.on

    def __repr__(self) -> str:
        """Name and settings."""
        return (
            f"TernaryDelta({self.strategy!r}, compressor={self.compressor!r}, "
            f"downlink={self.downlink!r}, error_feedback={self.error_feedback})"
        )

    def summary(self) -> None:
        """Log the settings, then the wrapped strategy's summary."""
        bound = self.admission.scale_bound
        log(_INFO, "\t├──> TernaryDelta settings:")
        log(_INFO, "\t│\t├── Compressor: %s (clip %.2f σ)", self.compressor, self.clip_sigma)
        log(_INFO, "\t│\t├── Downlink deltas: %s", self.downlink)
        if self.threshold_warmup_rounds:
            log(_INFO, "\t│\t├── Uplink cut: %g in rounds 1-%d, then the compressor's",
                self.warmup_threshold, self.threshold_warmup_rounds)
        log(_INFO, "\t│\t├── Scale bound: %g (%s)", bound.factor, bound.action)
        log(_INFO, "\t│\t└── Error feedback: %s", self.feedback)
        self.strategy.summary()

    # ------------------------------------------------------------------ rounds
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages, with the model as deltas where possible."""
        messages = self.strategy.configure_train(server_round, arrays, config, grid)
        self._feedback_for(server_round)
        return self._outgoing(messages, arrays, server_round)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Admit and decode the replies, aggregate them with the wrapped strategy; an
        aggregate that is not finite is not adopted (None: Flower keeps the model)."""
        arrays, metrics = self.strategy.aggregate_train(
            server_round, self._incoming(server_round, replies)
        )
        metrics = self.traffic_log.close(metrics)
        bad = None if arrays is None else non_finite_array(arrays)
        if bad is not None:
            self.skipped.append(server_round)
            log(_WARNING, "TernaryDelta skipped round %s: the aggregate's %r is not finite; "
                "the previous model is kept", server_round, bad)
            return None, metrics
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages, with the model as deltas where possible."""
        messages = self.strategy.configure_evaluate(server_round, arrays, config, grid)
        self._feedback_for(server_round)
        return self._outgoing(messages, arrays, server_round)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Strip this wrapper's records, then aggregate with the wrapped strategy."""
        incoming = self._incoming(server_round, replies)
        return self.traffic_log.close(self.strategy.aggregate_evaluate(server_round, incoming))

    @property
    def traffic(self) -> Traffic:
        """What was sent and saved over the run (each exchange's counts are in the
        aggregated metrics)."""
        return self.traffic_log.total

    # ------------------------------------------------------------------ downlink
    @property
    def version(self) -> int:
        """The broadcast model's version (0: none yet)."""
        return self.broadcast.version

    def broadcast_model(self) -> ArrayRecord | None:
        """The model the nodes hold (the last broadcast), as an ArrayRecord."""
        return self.broadcast.model()

    def _feedback_for(self, server_round: int) -> None:
        """The uplink's error feedback setting and cut that this round's messages carry."""
        self.broadcast.error_feedback = self.feedback.applies(server_round)
        early = server_round <= self.threshold_warmup_rounds
        self.broadcast.threshold = self.warmup_threshold if early else None

    def _outgoing(
        self, messages: Iterable[Message], arrays: ArrayRecord, server_round: int
    ) -> list[Message]:
        self.traffic_log.exchange = Traffic()
        out = []
        layout: Layout | None = None
        for message in messages:
            key = model_key(message, arrays)
            node = message.metadata.dst_node_id
            if key is None:
                if message.has_content() and message.content.array_records:
                    self.traffic_log.notices.note(node, "not-model", _NOT_MODEL)
                out.append(message)
                continue
            layout = layout_of(arrays) if layout is None else layout
            self._sent[node] = (message, key, layout)
            whole_bytes = array_bytes(message.content[key])
            if node in self._plain:
                self.traffic_log.plain_down(node, whole_bytes, "no-mod", _NO_MOD)
                out.append(message)
                continue
            self.broadcast.advance(arrays)
            whole = self.downlink == "grid" and not (self.assume_mod or node in self._modded)
            held = -1 if node in self._whole else self.admission.held(node)
            costly = whole or self.broadcast.costly(held)
            reach = self.admission.reach_from(
                node, server_round, held, self.broadcast.latest_base, costly
            )
            whole, held = whole and reach == held, reach  # held back: the latest update
            message.content = self.broadcast.content_for(held, message.content, key, whole)
            rebuilt = whole and self.broadcast.whole_rebuilds_grid() is not None
            (self._whole.add if whole and not rebuilt else self._whole.discard)(node)
            self.admission.nodes.sent(node, self.version, self.compressor)
            self._note_down(node, held, message.content, key, whole_bytes)
            out.append(message)
        return out

    def _note_down(self, node: int, held: int, content: RecordDict, key: str, whole: int) -> None:
        """Count a message to a node with the mod; say why when it carries the whole model."""
        sent = array_bytes(content[key], content.get(UPDATES), content.get(GRID))
        meta = content[META]
        compressed = isinstance(meta, ConfigRecord) and meta.get("base", -1) != -1
        known = self.traffic_log.down(node, compressed, whole, sent)
        if compressed:
            return
        reason, text = whole_model_reason(
            self.downlink, known, held, self.version - held,
            self.update_log_size, self.update_log_size * self.broadcast.steps,
        )  # fmt: skip
        level = _INFO if reason == "new" else _WARNING
        self.traffic_log.notices.note(node, f"{reason}@{self.version}" if reason == "new-broadcast"
                          else reason, text, level)  # fmt: skip

    # ------------------------------------------------------------------ uplink
    def _incoming(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies for the wrapped strategy: admitted ones restored to whole models,
        refused ones as error replies (see the module docstring)."""
        report = RoundReport(server_round, version=self.version)
        replies = list(replies)
        out: list[Message | None] = list(replies)
        sent: dict[int, Message] = {}
        compressed: list[ClientReply | ParseFailure] = []
        position: dict[int, tuple[int, str | None, list[str] | None]] = {}
        broadcast = self.broadcast
        others = {n: broadcast.layout[n] for n in broadcast.others}
        for index, reply in enumerate(replies):
            node = reply.metadata.src_node_id
            instruction = self._sent.pop(node, None)
            if instruction is not None:
                sent[node] = instruction[0]
            if reply.has_error():
                self.admission.forget(node)
                continue
            content = reply.content
            if META not in content:
                self.traffic_log.plain_up(node, content, _NO_MOD, "no-mod")
                admitted = instruction is not None and self.admission.admit_plain(
                    node, content, instruction[1], instruction[2], report
                )
                if admitted and node not in self._plain:  # the node runs no ternary_mod
                    self._plain.add(node)
                    self.admission.forget(node)
                continue
            self._modded.add(node)
            parsed = parse_delta_reply(node, content, others)
            meta = parsed.meta
            position[node] = (
                index,
                None if meta is None else meta.record,
                None if meta is None else meta.dtypes,
            )
            if meta is not None and meta.record is None:
                assert isinstance(parsed.reply, ClientReply)
                self.traffic_log.plain_up(node, content, _PLAIN_REPLY, "plain-reply")
                if self.admission.acknowledge(parsed.reply, report):
                    out[index] = without_ours(reply, None, None)
                    if instruction is not None:  # its arrays: as a plain reply's
                        self.admission.admit_plain(
                            node, reply.content, instruction[1], instruction[2], report
                        )
            else:
                compressed.append(parsed.reply)
        self._restore(compressed, replies, position, out, report)
        self.admission.nodes.end_round()
        for node in self._sent:  # no reply: it may or may not hold the broadcast
            self.admission.forget(node)
        self._sent.clear()
        self._account(report, replies, sent, out)
        return [reply for reply in out if reply is not None]

    def _restore(
        self,
        compressed: list[ClientReply | ParseFailure],
        replies: list[Message],
        position: dict[int, tuple[int, str | None, list[str] | None]],
        out: list[Message | None],
        report: RoundReport,
    ) -> None:
        """Admit the compressed replies; each admitted one becomes the wrapped strategy's
        model plus its delta, in the dtypes the client sent."""
        broadcast = self.broadcast
        wire = {n: t.to(UPLINK_DTYPE) for n, t in broadcast.floats.items()}
        held = [str(t.numpy().dtype) for t in broadcast.floats.values()]
        admitted = self.admission.admit(
            compressed,
            wire,
            self.version,
            self.compressor,
            self.clip_sigma,
            report,
            self.scale_bucket,
        )
        for node, delta in self.admission.directed(admitted, report):
            index, record, dtypes = position[node]
            weights = restored(broadcast.exact, delta, dtypes or held)
            bad = next((n for n, w in weights.items() if not bool(torch.isfinite(w).all())), None)
            if bad is not None:
                self.admission.refuse(report, node, PayloadRejected(
                    f"node {node} payload rejected: the model plus its delta of {bad!r} is "
                    "not finite"
                ))  # fmt: skip
                continue
            content = replies[index].content
            sent = content.get(record or "")
            assert isinstance(sent, ArrayRecord)  # parse_delta_reply checked it
            model = join_model(broadcast.names, weights, dict(sent.items()))
            sent_bytes = array_bytes(sent, content.get(DELTA))
            self.traffic_log.exchange.up(True, array_bytes(model), sent_bytes)
            out[index] = without_ours(replies[index], record, model)

    def _account(
        self,
        report: RoundReport,
        replies: list[Message],
        sent: dict[int, Message],
        out: list[Message | None],
    ) -> None:
        """Log and count what ``report`` dropped and clipped; dropped replies become error
        replies (or vanish, when the node was sent nothing to answer)."""
        self.last_report = report
        for node in report.clipped:
            self.clipped[node] = self.clipped.get(node, 0) + 1
        for index, reply in enumerate(replies):
            node = reply.metadata.src_node_id
            if node not in report.dropped or reply.has_error():
                continue
            error = report.errors.get(node)
            kind = fault_kind(error)
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            why = report.dropped[node]
            reason = f"TernaryDelta dropped the reply of node {node} ({kind}): {why}"
            log(_WARNING, reason)
            instruction = sent.get(node)
            out[index] = None if instruction is None else error_reply(instruction, reason)


_NO_MOD = "runs no ternary_mod: its messages and replies travel plain"
_NOT_MODEL = (
    "got a message whose arrays are not the global model's layout: sent as the strategy "
    "built it"
)
_PLAIN_REPLY = "sent its reply's arrays uncompressed (its ternary_mod logs why)"
