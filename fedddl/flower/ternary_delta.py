"""``TernaryDelta``: a Flower strategy wrapper that sends and receives ternary model deltas.

Wrap any Flower :class:`~flwr.serverapp.strategy.Strategy`; add
:func:`fedddl.flower.ternary_mod` to the ClientApp; nothing else changes::

    from flwr.serverapp.strategy import FedAvg
    from fedddl.flower import TernaryDelta

    strategy = TernaryDelta(FedAvg(fraction_train=0.5))
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)

**Downlink** (:mod:`fedddl.flower.delta_broadcast`). Whenever the wrapped strategy hands
out a new global model, the wrapper moves its *broadcast model* (what the clients hold)
towards it by one ternary-encoded delta: the whole gap between the new global model and
the broadcast model, so what one delta could not carry is sent with the next (error
feedback without a residual). It keeps the last ``update_log_size`` encoded deltas. A
node that holds a recent version receives only the deltas it misses (the training and
evaluation messages of one round share one delta); a new node, one further behind, or one
whose last reply failed gets the whole broadcast model. The first round is therefore full
size.

**Uplink.** The mod encodes each reply's model as ``reply - broadcast model`` (with a
client-side residual memory for error feedback); the wrapper decodes it and adds it to
the *exact* global model the wrapped strategy handed out, so the wrapped strategy sees
replies as if the clients had trained from its own model, and no downlink error
accumulates in the global model.

**Untrusted replies.** Compressed replies pass TernGrad's admission pipeline
(:mod:`fedddl.flower.delta_admission`): version, payload header against the broadcast
model before any value is decoded, the scale bound, finiteness. A plain reply (a node
without the mod) must have the sent model's layout and finite values. A reply that fails
is replaced by an error reply naming the node and the reason (the wrapped strategy counts
it as a failure) and that node gets the whole model next time. An aggregate that is not
finite is not adopted: the round keeps the previous model. The wrapper never raises on a
reply. Nodes without the mod (no ``"fedddl.ternary"`` record) get the wrapped strategy's
messages unchanged after their first reply; messages that carry no model (e.g. queries)
pass through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedddl.compression import make_compressor
from fedddl.flower.delta_admission import (
    DeltaAdmission,
    Layout,
    check_plain_reply,
    layout_of,
    parse_delta_reply,
)
from fedddl.flower.delta_broadcast import DeltaBroadcast
from fedddl.flower.delta_protocol import DELTA, META, join_model, same_layout
from fedddl.sync.errors import PayloadRejected, ReplyError
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
        Registered compressor, up and down. The default, deterministic threshold ternary
        (base-3 packed), is contractive, which error feedback needs; TernGrad's stochastic
        ternary (``"ternary-base3"``) is unbiased but its noise accumulates under FedAvg.
    clip_sigma : float
        Ternary clipping of each delta tensor, in standard deviations.
    error_feedback : bool
        Residual memory on each client for the uplink (what a delta could not carry is
        sent later); the downlink corrects its error by construction.
    downlink : bool
        Send deltas of the global model to nodes that hold the previous broadcast
        (``False``: every message carries the whole, exact global model).
    update_log_size : int
        Encoded downlink deltas kept for nodes that missed rounds.
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
        values, -1 one per output channel (sent to the nodes in :data:`META`).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        compressor: str = "ternary-threshold-base3",
        clip_sigma: float = 2.5,
        error_feedback: bool = True,
        downlink: bool = True,
        update_log_size: int = 4,
        scale_bound: float = 8.0,
        scale_bound_action: str = "drop",
        scale_bound_rounds: int = 0,
        seed: int = 0,
        scale_bucket: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Flower Strategy, got {type(strategy).__name__}")
        if update_log_size < 0:
            raise ValueError(f"update_log_size must be >= 0, got {update_log_size}")
        if not clip_sigma > 0:
            raise ValueError(f"clip_sigma must be > 0, got {clip_sigma}")
        make_compressor(  # unknown name, bad scale_bucket: ValueError
            compressor, seed=0, clip_sigma=clip_sigma, scale_bucket=scale_bucket
        )
        self.scale_bucket = scale_bucket
        self.strategy = strategy
        self.compressor = compressor
        self.clip_sigma = float(clip_sigma)
        self.error_feedback = error_feedback
        self.downlink = downlink
        self.update_log_size = update_log_size
        self.seed = seed
        self.broadcast = DeltaBroadcast(
            compressor, clip_sigma, error_feedback, downlink, update_log_size, seed, scale_bucket
        )
        #: Dropped replies by the kind of error; clipped replies by node; the rounds whose
        #: aggregate was not finite; the last exchange's report.
        self.dropped: dict[str, int] = {}
        self.clipped: dict[int, int] = {}
        self.skipped: list[int] = []
        self.last_report: RoundReport | None = None
        self.admission = DeltaAdmission(
            ScaleBound(scale_bound, scale_bound_action, scale_bound_rounds)
        )
        self._plain: set[int] = set()
        self._sent: dict[int, tuple[Message, str, Layout]] = {}

    def __repr__(self) -> str:
        """Name and settings."""
        return (
            f"TernaryDelta({self.strategy!r}, compressor={self.compressor!r}, "
            f"downlink={self.downlink}, error_feedback={self.error_feedback})"
        )

    def summary(self) -> None:
        """Log the settings, then the wrapped strategy's summary."""
        bound = self.admission.scale_bound
        log(_INFO, "\t├──> TernaryDelta settings:")
        log(_INFO, "\t│\t├── Compressor: %s (clip %.2f σ)", self.compressor, self.clip_sigma)
        log(_INFO, "\t│\t├── Downlink deltas: %s", self.downlink)
        log(_INFO, "\t│\t├── Scale bound: %g (%s)", bound.factor, bound.action)
        log(_INFO, "\t│\t└── Error feedback: %s", self.error_feedback)
        self.strategy.summary()

    # ------------------------------------------------------------------ rounds
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages, with the model as deltas where possible."""
        messages = self.strategy.configure_train(server_round, arrays, config, grid)
        return self._outgoing(messages, arrays)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Admit and decode the replies, aggregate them with the wrapped strategy; an
        aggregate that is not finite is not adopted (None: Flower keeps the model)."""
        arrays, metrics = self.strategy.aggregate_train(
            server_round, self._incoming(server_round, replies)
        )
        bad = None if arrays is None else _non_finite_array(arrays)
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
        return self._outgoing(messages, arrays)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Strip this wrapper's records, then aggregate with the wrapped strategy."""
        return self.strategy.aggregate_evaluate(server_round, self._incoming(server_round, replies))

    # ------------------------------------------------------------------ downlink
    @property
    def version(self) -> int:
        """The broadcast model's version (0: none yet)."""
        return self.broadcast.version

    def broadcast_model(self) -> ArrayRecord | None:
        """The model the nodes hold (the last broadcast), as an ArrayRecord."""
        return self.broadcast.model()

    def _outgoing(self, messages: Iterable[Message], arrays: ArrayRecord) -> list[Message]:
        out = []
        layout: Layout | None = None
        for message in messages:
            key = _model_key(message, arrays)
            node = message.metadata.dst_node_id
            if key is None:
                out.append(message)
                continue
            layout = layout_of(arrays) if layout is None else layout
            self._sent[node] = (message, key, layout)
            if node not in self._plain:
                self.broadcast.advance(arrays)
                held = self.admission.held(node)
                message.content = self.broadcast.content_for(held, message.content, key)
                self.admission.nodes.sent(node, self.version, self.compressor)
            out.append(message)
        return out

    # ------------------------------------------------------------------ uplink
    def _incoming(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies for the wrapped strategy: admitted ones restored to whole models,
        refused ones as error replies (see the module docstring)."""
        report = RoundReport(server_round, version=self.version)
        replies = list(replies)
        out: list[Message | None] = list(replies)
        sent: dict[int, Message] = {}
        compressed: list[ClientReply | ParseFailure] = []
        position: dict[int, tuple[int, str | None]] = {}
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
                if instruction is not None:
                    self._admit_plain(node, content, instruction[1:], report)
                continue
            parsed = parse_delta_reply(node, content, others)
            position[node] = (index, None if parsed.meta is None else parsed.meta.record)
            if parsed.meta is not None and parsed.meta.record is None:
                assert isinstance(parsed.reply, ClientReply)
                if self.admission.acknowledge(parsed.reply, report):
                    out[index] = _without_ours(reply, None, None)
            else:
                compressed.append(parsed.reply)
        self._restore(compressed, replies, position, out, report)
        self.admission.nodes.end_round()
        for node in self._sent:  # no reply: it may or may not hold the broadcast
            self.admission.forget(node)
        self._sent.clear()
        self._account(report, replies, sent, out)
        return [reply for reply in out if reply is not None]

    def _admit_plain(
        self, node: int, content: RecordDict, asked: tuple[str, Layout], report: RoundReport
    ) -> None:
        key, layout = asked
        try:
            check_plain_reply(node, content, key, layout)
        except PayloadRejected as err:
            self.admission.refuse(report, node, err)
            return
        if node not in self._plain:  # the node runs no ternary_mod
            self._plain.add(node)
            self.admission.forget(node)

    def _restore(
        self,
        compressed: list[ClientReply | ParseFailure],
        replies: list[Message],
        position: dict[int, tuple[int, str | None]],
        out: list[Message | None],
        report: RoundReport,
    ) -> None:
        """Admit the compressed replies; each admitted one becomes the wrapped strategy's
        model plus its delta."""
        broadcast = self.broadcast
        admitted = self.admission.admit(
            compressed,
            broadcast.floats,
            self.version,
            self.compressor,
            self.clip_sigma,
            report,
            self.scale_bucket,
        )
        for node, delta in admitted:
            weights = {n: broadcast.exact[n] + delta[n] for n in broadcast.floats}
            bad = next((n for n, w in weights.items() if not bool(torch.isfinite(w).all())), None)
            if bad is not None:
                self.admission.refuse(report, node, PayloadRejected(
                    f"node {node} payload rejected: the model plus its delta of {bad!r} is "
                    "not finite"
                ))  # fmt: skip
                continue
            index, record = position[node]
            sent = replies[index].content.get(record or "")
            assert isinstance(sent, ArrayRecord)  # parse_delta_reply checked it
            model = join_model(broadcast.names, weights, dict(sent.items()))
            out[index] = _without_ours(replies[index], record, model)

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
            kind = _kind(error)
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            why = report.dropped[node]
            reason = f"TernaryDelta dropped the reply of node {node} ({kind}): {why}"
            log(_WARNING, reason)
            instruction = sent.get(node)
            out[index] = None if instruction is None else Message(
                Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason),
                reply_to=instruction,
            )  # fmt: skip


def _without_ours(reply: Message, record: str | None, model: ArrayRecord | None) -> Message:
    """``reply`` without this wrapper's records, its ``record`` replaced by ``model``."""
    out = RecordDict()
    for name, found in reply.content.items():
        if name in (META, DELTA):
            continue
        out[name] = model if name == record and model is not None else found
    reply.content = out
    return reply


def _kind(error: ReplyError | None) -> str:
    """The kind of fault: the error that caused the rejection, else the rejection's class."""
    if error is None:
        return "rejected"
    cause = error.__cause__
    return type(cause if isinstance(cause, Exception) else error).__name__


def _model_key(message: Message, arrays: ArrayRecord) -> str | None:
    """Name of the record in ``message`` that carries the global model, if any."""
    if message.has_error() or not message.has_content():
        return None
    records = message.content.array_records
    for key, record in records.items():
        if record is arrays:
            return key
    for key, record in records.items():
        if same_layout(record, arrays):
            return key
    return None


def _non_finite_array(arrays: ArrayRecord) -> str | None:
    """The name of a float Array of ``arrays`` with a non-finite value, if any."""
    for name, array in arrays.items():
        try:
            values = array.numpy()
        except Exception:  # not readable: not ours to judge
            continue
        if values.dtype.kind == "f" and not bool(np.isfinite(values).all()):
            return name
    return None
