"""Reply admission: every check a reply passes, in order, from parse to finite values.

:data:`REPLY_CHECKS`, :data:`ROUND_BOUNDS` and :data:`VALUE_CHECKS` list the defences (one
entry each, :mod:`fedddl.sync.reply_checks`); :class:`ReplyAdmission` runs them. A reply
that fails one is dropped with its reason in the round's report; no exception raised while
handling one reply ends the round. Admitted replies are decoded one at a time (small ones in
batches) into one reused buffer, so server memory stays flat in the number of clients.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from logging import DEBUG, WARNING, getLogger

import torch
from torch import nn

from fedddl.compression import PayloadError
from fedddl.compression import make_compressor as build_compressor
from fedddl.compression.codecs.wire import decode_small_batch
from fedddl.replica import ReplicaError
from fedddl.running_stats import StatisticsError
from fedddl.sync.aggregation import Contribution
from fedddl.sync.errors import FingerprintMismatch, PayloadRejected, ReplyError
from fedddl.sync.messages import ClientReply, ParseFailure
from fedddl.sync.nodes import NodeBook
from fedddl.sync.reply_checks import (
    Candidate,
    ReplyCheck,
    RoundBound,
    RoundRules,
    Screened,
    ValueCheck,
    apply_clip,
    bound_scales,
    bound_statistics_to_shadow_values,
    bound_statistics_values,
    bucket_peaks,
    check_finite,
    check_header,
    check_local_scales,
    check_round,
    check_statistics_of,
    dense_peaks,
)
from fedddl.sync.report import RoundReport
from fedddl.sync.resync_limit import ResyncLimiter
from fedddl.sync.screening import PayloadSpec

__all__ = ["BATCH_DECODE_BYTES", "REPLY_CHECKS", "ROUND_BOUNDS", "VALUE_CHECKS", "ReplyAdmission"]

logger = getLogger("fedddl")

#: Parsing comes first (:class:`ParseFailure`: the transport could not read the reply).
#: Then each reply alone, before any gradient value is decoded:
REPLY_CHECKS: tuple[ReplyCheck, ...] = (
    check_round,  # asked this round; version; fingerprint (the override point)
    check_header,  # payload header against the model and the round's compressor
    check_local_scales,  # one local scale per tensor (shared-scale-sum)
    check_statistics_of,  # BatchNorm statistics: size, shapes, range
)
#: Then the round's screened replies together:
ROUND_BOUNDS: tuple[RoundBound, ...] = (
    bound_scales,  # header scales within k × the honest majority's
    bound_statistics_values,  # BatchNorm statistics within k × the median
    bound_statistics_to_shadow_values,  # and within k deviations of the shadow's own
)
#: Then each reply's decoded values:
VALUE_CHECKS: tuple[ValueCheck, ...] = (
    apply_clip,  # what the round bounds clip
    check_finite,  # no non-finite value the header does not vouch for
)

#: Float32 bytes of small models' replies decoded at once.
BATCH_DECODE_BYTES = 4 << 20


def combination_key(reply: ClientReply) -> tuple[int, int, int]:
    """The order in which admitted replies are combined: by reported partition, node id
    last (no partition: after the others). Float sums depend on their order; arrival order
    and simulated node ids vary from run to run, partitions do not."""
    if reply.partition_id is None:
        return (1, 0, reply.node_id)
    return (0, reply.partition_id, reply.node_id)


class ReplyAdmission:
    """Runs the checks over a round's replies, telling ``nodes`` and ``resyncs`` what each
    reply showed about its node. A clip is logged at WARNING the first time a node is
    clipped by a round bound, at DEBUG afterwards (every clip stays in the round's report)."""

    def __init__(self, nodes: NodeBook, resyncs: ResyncLimiter) -> None:
        self.nodes = nodes
        self.resyncs = resyncs
        self._specs: dict[tuple[str, int], PayloadSpec] = {}
        self._warned: set[tuple[int, str]] = set()  # (node, round bound) clips logged

    def spec(
        self,
        compressor: str,
        model: nn.Module,
        clip_sigma: float,
        dense: frozenset[str],
        scale_bucket: int = 0,
    ) -> PayloadSpec:
        """What replies encoded with ``compressor`` (and ``scale_bucket``) must look like
        (cached by both)."""
        spec = self._specs.get((compressor, scale_bucket))
        if spec is None:
            encoder = build_compressor(
                compressor, seed=0, clip_sigma=clip_sigma, scale_bucket=scale_bucket
            )
            spec = PayloadSpec.for_model(model, encoder, dense=dense)
            self._specs[(compressor, scale_bucket)] = spec
        return spec

    def screen(
        self,
        replies: Iterable[ClientReply | ParseFailure],
        rules: RoundRules,
        report: RoundReport,
    ) -> list[Screened]:
        """The replies that pass :data:`REPLY_CHECKS` and :data:`ROUND_BOUNDS`, in
        combination order (:func:`combination_key`); the others dropped in ``report``."""
        screened = [s for s in (self._check(item, rules, report) for item in replies) if s]
        self.nodes.end_round()
        clip: dict[int, dict[str, float]] = {}
        clipped: dict[int, str] = {}
        first: set[int] = set()  # nodes clipped for a reason not logged before
        for bound in ROUND_BOUNDS:
            verdict = bound(screened, rules)
            for node, why in verdict.dropped.items():
                drop(report, node, PayloadRejected(why))
            screened = [s for s in screened if s.reply.node_id not in verdict.dropped]
            for node, why in verdict.clipped.items():
                clipped[node] = f"{clipped[node]}; {why}" if node in clipped else why
                if (node, bound.__name__) not in self._warned:
                    self._warned.add((node, bound.__name__))
                    first.add(node)
            for node, tensors in verdict.clip.items():
                clip.setdefault(node, {}).update(tensors)
        for node, why in clipped.items():
            report.clipped[node] = why
            logger.log(WARNING if node in first else DEBUG, "clipping reply: %s", why)
        bounded = [
            Screened(s.reply, s.message, clip.get(s.reply.node_id, {}), s.statistics)
            for s in screened
        ]
        return sorted(bounded, key=lambda s: combination_key(s.reply))

    def _check(
        self, item: ClientReply | ParseFailure, rules: RoundRules, report: RoundReport
    ) -> Screened | None:
        """One reply through :data:`REPLY_CHECKS`; None (and a drop) if one fails."""
        if isinstance(item, ParseFailure):
            self.resyncs.unreadable(item.node_id)
            drop(report, item.node_id, item.error)
            return None
        candidate = Candidate(item, self.nodes.expected_version(item.node_id))
        error: ReplyError | None = None
        try:
            for check in REPLY_CHECKS:
                check(candidate, rules)
        except ReplyError as err:
            error = err
        except Exception as err:  # a bug in an override on hostile input must not end the round
            error = PayloadRejected(
                f"node {item.node_id} reply rejected: {type(err).__name__}: {err}"
            )
        self.nodes.learn(item, error)
        self.resyncs.learn(item.node_id, error)
        if error is not None:
            drop(report, item.node_id, error)
            return None
        assert candidate.message is not None  # check_header passed
        report.note_fingerprint_checked(item.node_id)
        return Screened(item, candidate.message, {}, candidate.statistics)

    def decoded(
        self, screened: list[Screened], scratch: dict[str, torch.Tensor], report: RoundReport
    ) -> Iterator[Contribution]:
        """Each screened reply decoded into ``scratch`` (overwritten by the next) and put
        through :data:`VALUE_CHECKS`; those that fail are dropped, not yielded. Small replies
        are decoded in batches of at most :data:`BATCH_DECODE_BYTES` (the same values)."""
        numel = sum(t.numel() for t in scratch.values())
        per_batch = max(1, BATCH_DECODE_BYTES // max(1, 4 * numel))
        for first in range(0, len(screened), per_batch):
            chunk = screened[first : first + per_batch]
            try:
                batch = decode_small_batch([item.message for item in chunk], scratch)
            except Exception:  # a decoder bug on hostile input: one by one, which blames one
                batch = None
            for position, item in enumerate(chunk):
                values = None if batch is None else batch[position]
                contribution = _contribution(item, scratch, values, report)
                if contribution is not None:
                    yield contribution


def _contribution(
    item: Screened,
    scratch: dict[str, torch.Tensor],
    decoded: dict[str, torch.Tensor] | None,
    report: RoundReport,
) -> Contribution | None:
    """One screened reply's values (``decoded``, else decoded into ``scratch``) through
    :data:`VALUE_CHECKS`; None (and a drop) if they fail."""
    reply = item.reply
    scales = {e.name: e.scale for e in item.entries if e.codec is not None and not e.bucket}
    # an entry with scale buckets is bounded by its largest bucket scale, and clipped by
    # clamping (each bucket's scale to at most the cap), like a dense entry
    peaks = {**dense_peaks(item.entries), **bucket_peaks(item.entries)}
    try:
        try:
            values = item.message.decode(out=scratch) if decoded is None else decoded
            for check in VALUE_CHECKS:
                check(item, values, scales, peaks)
        except (PayloadError, ReplicaError, StatisticsError) as err:
            raise PayloadRejected(f"node {reply.node_id} payload rejected: {err}") from err
        except Exception as err:  # a decoder bug on hostile input must not end the round
            raise PayloadRejected(
                f"node {reply.node_id} payload rejected: {type(err).__name__}: {err}"
            ) from err
    except PayloadRejected as err:
        drop(report, reply.node_id, err)
        return None
    return Contribution(reply, values, scales=scales, statistics=item.statistics, peaks=peaks)


def drop(report: RoundReport, node: int, error: ReplyError, level: int = WARNING) -> None:
    """Record (and log at ``level``) that ``node``'s reply is dropped for ``error``."""
    report.dropped[node] = str(error)
    report.errors[node] = error
    if isinstance(error, FingerprintMismatch):
        report.note_fingerprint_checked(node, mismatch=True)
    logger.log(level, "dropping reply: %s", error)
