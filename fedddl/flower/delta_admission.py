"""Admission of :class:`~fedddl.flower.TernaryDelta`'s replies: TernGrad's pipeline, reused.

A compressed reply is read into a :class:`~fedddl.sync.messages.ClientReply` (its encoded
model delta as the payload) and put through :class:`fedddl.sync.admission.ReplyAdmission`,
the checks TernGrad's replies pass, in the same order: the version the node was sent, the
payload header against the broadcast model (names, shapes, dtypes, codec, size) before any
value is decoded, the scale bound of the round's honest majority, then finiteness of the
decoded values. A plain reply (no mod) is checked for the sent model's layout and finite
values. Whatever fails is dropped with its reason in a :class:`~fedddl.sync.report.RoundReport`;
nothing here raises on a reply's content.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from torch import nn

from fedddl.compression import make_compressor
from fedddl.flower.delta_protocol import DELTA, DELTA_KEY, ReplyMeta, parse_reply_meta
from fedddl.flower.records import array_to_bytes
from fedddl.sync.admission import ReplyAdmission, drop
from fedddl.sync.direction import DirectionCheck
from fedddl.sync.errors import (
    OpposedDirection,
    PayloadRejected,
    ReplyError,
    UnexpectedReply,
    VersionMismatch,
)
from fedddl.sync.messages import ClientReply, ParseFailure
from fedddl.sync.nodes import NodeBook
from fedddl.sync.reply_checks import RoundRules
from fedddl.sync.report import RoundReport
from fedddl.sync.resync_limit import ResyncLimiter
from fedddl.sync.scale_bound import ScaleBound
from fedddl.sync.screening import PayloadSpec

__all__ = [
    "DIRECTION_NOISE",
    "DeltaAdmission",
    "Layout",
    "check_plain_reply",
    "parse_delta_reply",
]

#: The drop-in's direction check keeps a reply whose alignment lies within this many
#: ``1 / sqrt(nnz)`` (the spread of an uncorrelated reply's alignment) of the round's median
#: (:class:`~fedddl.sync.direction.DirectionCheck`'s ``noise``): late in training honest
#: replies' alignments come within noise of 0, where ``fraction × median`` alone drops some.
DIRECTION_NOISE = 3.0

#: name -> (dtype, shape) of a model record's Arrays, in order.
Layout = dict[str, tuple[str, tuple[int, ...]]]


def layout_of(record: ArrayRecord) -> Layout:
    """The names, dtypes and shapes of ``record``'s Arrays (nothing is read)."""
    return {n: (str(a.dtype), tuple(int(d) for d in a.shape)) for n, a in record.items()}


@dataclass(frozen=True)
class DeltaReply:
    """A compressed reply read into the admission pipeline's terms."""

    reply: ClientReply | ParseFailure
    meta: ReplyMeta | None


def parse_delta_reply(node: int, content: RecordDict, others: Layout) -> DeltaReply:
    """Read a reply carrying :data:`~fedddl.flower.delta_protocol.META`: its version and, if
    it sent its model as a delta, the encoded delta as the payload. Only record names and
    sizes are read; a malformed reply is a :class:`ParseFailure`. ``others``: the layout of
    the model's non-float Arrays, which the reply's model record must hold exactly."""
    try:
        meta = parse_reply_meta(content)
        if meta.record is None:
            if DELTA in content:
                raise ValueError(f"it holds a {DELTA!r} record but names no model record")
            return DeltaReply(ClientReply(node, meta.version, "", b"", 0, float("nan")), meta)
        model_record = content.get(meta.record)
        if not isinstance(model_record, ArrayRecord):
            raise ValueError(f"it has no ArrayRecord {meta.record!r}")
        if layout_of(model_record) != others:
            raise ValueError(f"record {meta.record!r} must hold exactly the non-float arrays")
        if meta.dtypes is not None and len(meta.dtypes) != len(meta.names or []) - len(others):
            raise ValueError("its 'dtypes' do not name one dtype per compressed array")
        holder = content.get(DELTA)
        if not isinstance(holder, ArrayRecord) or list(holder.keys()) != [DELTA_KEY]:
            raise ValueError(f"it has no {DELTA!r} ArrayRecord with a {DELTA_KEY!r} Array")
        payload = array_to_bytes(holder[DELTA_KEY])
    except ValueError as err:
        return DeltaReply(ParseFailure(node, PayloadRejected(f"node {node}: {err}")), None)
    return DeltaReply(ClientReply(node, meta.version, "", payload, 0, float("nan")), meta)


def check_plain_reply(node: int, content: RecordDict, key: str, layout: Layout) -> None:
    """A reply without the mod: its record ``key`` (if any) has the sent model's names and
    shapes (an integer array may come back as floats, or the reverse), and every float
    Array of the reply is finite.

    Raises
    ------
    PayloadRejected
        Naming the node and the first fault.
    """
    what = f"node {node} plain reply rejected"
    record = content.get(key)
    if isinstance(record, ArrayRecord):
        if list(record.keys()) != list(layout):
            raise PayloadRejected(f"{what}: record {key!r} does not hold the model's arrays")
        for name, array in record.items():
            shape = tuple(int(d) for d in array.shape)
            if shape != layout[name][1] or _kind(array) not in "fiub":
                raise PayloadRejected(
                    f"{what}: array {name!r} is {array.dtype}{list(shape)}, the model's is "
                    f"{layout[name][0]}{list(layout[name][1])}"
                )
    for record_name, found in content.items():
        if not isinstance(found, ArrayRecord):
            continue
        for name, array in found.items():
            if _kind(array) == "f" and not _finite(array):
                raise PayloadRejected(
                    f"{what}: array {name!r} of {record_name!r} holds non-finite values"
                )


def _kind(array: Array) -> str:
    try:
        return str(np.dtype(array.dtype).kind)
    except TypeError:
        return "?"


def _finite(array: Array) -> bool:
    try:
        return bool(np.isfinite(array.numpy()).all())
    except Exception:  # a malformed Array: whatever numpy raises
        return False


#: A delta scale below ``RELATIVE_FLOOR × max|w| + ABSOLUTE_FLOOR`` of its tensor ``w`` is
#: never over the bound: a tensor that does not learn (a bias before BatchNorm) has deltas
#: of float noise, whose median says nothing.
RELATIVE_FLOOR, ABSOLUTE_FLOOR = 1e-3, 1e-6


def scale_floor(tensor: torch.Tensor) -> float:
    """The smallest scale bound of ``tensor``'s deltas (see :data:`RELATIVE_FLOOR`)."""
    peak = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    return RELATIVE_FLOOR * peak + ABSOLUTE_FLOOR if math.isfinite(peak) else ABSOLUTE_FLOOR


class DeltaAdmission:
    """What each node holds, and the admission of its replies (see the module docstring).

    Parameters
    ----------
    scale_bound : ScaleBound
        The bound on the delta scales (its history spans the run).
    resync_interval : int
        A node whose reply lost the server's track of it (an error, no reply, a refused
        reply, another version) is resynced at most once every this many rounds
        (:class:`~fedddl.sync.resync_limit.ResyncLimiter`; 0: no limit).
    direction : DirectionCheck, optional
        The direction check of the admitted deltas (:meth:`directed`; none: off).
    """

    def __init__(
        self,
        scale_bound: ScaleBound,
        resync_interval: int = 0,
        direction: DirectionCheck | None = None,
    ) -> None:
        self.nodes = NodeBook(unknown_version=-1)
        self.scale_bound = scale_bound
        self.direction = direction or DirectionCheck(0.0)
        self.resyncs = ResyncLimiter(resync_interval)
        self._admission = ReplyAdmission(self.nodes, self.resyncs)
        self._specs: dict[tuple[object, ...], PayloadSpec] = {}

    def held(self, node: int) -> int:
        """The broadcast version ``node`` holds (-1: unknown, send the whole model)."""
        return self.nodes.known_version(node)

    def forget(self, node: int) -> None:
        """``node`` may not hold a broadcast model: send it the whole model next time (a
        resync it caused, rate-limited)."""
        self.nodes.version[node] = -1
        self.resyncs.unreadable(node)

    def reach_from(
        self, node: int, server_round: int, held: int, latest_base: int, costly: bool
    ) -> int:
        """The version to send ``node`` the catch-up from: ``held``, or, while its resyncs
        are held back and that catch-up is ``costly``, ``latest_base`` (the version the
        latest update starts from: all an honest node that holds it needs)."""
        if not costly:
            return held
        if self.resyncs.holds_back(node, server_round):
            return latest_base
        self.resyncs.served(node, server_round)
        return held

    def admit(
        self,
        replies: list[ClientReply | ParseFailure],
        floats: Mapping[str, torch.Tensor],
        current: int,
        compressor: str,
        clip_sigma: float,
        report: RoundReport,
        scale_bucket: int = 0,
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Each admitted reply's node and decoded delta (a buffer overwritten by the next),
        in combination order; the others dropped in ``report``. ``floats``: the broadcast
        model at ``current``."""

        def validate(reply: ClientReply, expected: int | None) -> None:
            node = reply.node_id
            if expected is None:
                raise UnexpectedReply(f"node {node} was not sent a model or already replied")
            if reply.model_version != expected:
                raise VersionMismatch(
                    f"node {node} answers version {reply.model_version}, the server sent "
                    f"{expected}"
                )
            if expected != current:
                raise VersionMismatch(
                    f"node {node}: its delta is not against the current broadcast model"
                )

        rules = RoundRules(
            validate=validate,
            spec=self._spec(compressor, clip_sigma, floats, scale_bucket),
            shared_sum=False,
            num_tensors=len(floats),
            model=nn.Module(),
            batchnorm={},
            scale_bound=self.scale_bound,
            code_scales=None,
            scale_floors={n: scale_floor(t) for n, t in floats.items()},
        )
        screened = self._admission.screen(replies, rules, report)
        scratch = {n: torch.empty_like(t) for n, t in floats.items()}
        for contribution in self._admission.decoded(screened, scratch, report):
            yield contribution.reply.node_id, dict(contribution.gradient)
        for node in report.dropped:
            self.forget(node)

    def acknowledge(self, reply: ClientReply, report: RoundReport) -> bool:
        """Whether a reply that carries no model answers the version its node was sent
        (else it is dropped in ``report``)."""
        node, expected = reply.node_id, self.nodes.expected_version(reply.node_id)
        error: UnexpectedReply | VersionMismatch | None = None
        if expected is None:
            error = UnexpectedReply(f"node {node} was not sent a model or already replied")
        elif reply.model_version != expected:
            error = VersionMismatch(
                f"node {node} answers version {reply.model_version}, the server sent {expected}"
            )
        self.nodes.learn(reply, error)
        self.resyncs.learn(node, error)
        if error is not None:
            self.refuse(report, node, error)
        return error is None

    def admit_plain(
        self, node: int, content: RecordDict, key: str, layout: Layout, report: RoundReport
    ) -> bool:
        """Whether a reply whose arrays travelled plain passes :func:`check_plain_reply`
        for the record ``key`` of the sent ``layout`` (else refused in ``report``)."""
        try:
            check_plain_reply(node, content, key, layout)
        except PayloadRejected as err:
            self.refuse(report, node, err)
            return False
        return True

    def directed(
        self, admitted: Iterable[tuple[int, dict[str, torch.Tensor]]], report: RoundReport
    ) -> Iterable[tuple[int, dict[str, torch.Tensor]]]:
        """The admitted deltas whose direction passes :attr:`direction` (copies when it is
        on); the others are dropped in ``report`` (the node still holds the broadcast model,
        so it is not forgotten)."""
        if not self.direction.enabled:
            return admitted
        kept = [(node, {n: t.clone() for n, t in delta.items()}) for node, delta in admitted]
        passed = []
        for (node, delta), verdict in zip(kept, self.direction.screen(kept), strict=True):
            if verdict.reason:
                level = self.direction.log_level(node)
                drop(report, node, OpposedDirection(verdict.reason), level)
            else:
                passed.append((node, delta))
        return passed

    def refuse(self, report: RoundReport, node: int, error: ReplyError) -> None:
        """Drop ``node``'s reply for ``error`` (found after admission)."""
        drop(report, node, error)
        self.forget(node)

    def _spec(
        self,
        compressor: str,
        clip_sigma: float,
        floats: Mapping[str, torch.Tensor],
        scale_bucket: int = 0,
    ) -> PayloadSpec:
        layout = tuple((n, str(t.dtype), tuple(t.shape)) for n, t in floats.items())
        key = (compressor, clip_sigma, scale_bucket, layout)
        spec = self._specs.get(key)
        if spec is None:
            self._specs.clear()  # one model layout at a time
            spec = self._specs[key] = PayloadSpec.for_shapes(
                {n: tuple(int(d) for d in t.shape) for n, t in floats.items()},
                make_compressor(
                    compressor, seed=0, clip_sigma=clip_sigma, scale_bucket=scale_bucket
                ),
                dtypes={n: t.dtype for n, t in floats.items()},
            )
        return spec
