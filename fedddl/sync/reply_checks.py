"""The defences a reply passes, one function each; :mod:`fedddl.sync.admission` orders them.

Three kinds: a :data:`ReplyCheck` looks at one reply before any gradient value is decoded,
a :data:`RoundBound` at the round's screened replies together, a :data:`ValueCheck` at one
reply's decoded values. Each raises (or reports) a :class:`~fedddl.sync.errors.ReplyError`
naming the reply's fault.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedddl.compression import EntryHeader, OpenedMessage, PayloadError, decode_update
from fedddl.replica import ReplicaError
from fedddl.running_stats import StatisticsError, check_statistics
from fedddl.sync.errors import (
    FingerprintMismatch,
    PayloadRejected,
    ResyncRequest,
    UnexpectedReply,
    VersionMismatch,
)
from fedddl.sync.messages import ClientReply, fingerprint_prefix
from fedddl.sync.scale_bound import ScaleBound
from fedddl.sync.screening import PayloadSpec
from fedddl.sync.statistics_bound import bound_statistics, check_statistics_range
from fedddl.sync.statistics_shadow import bound_statistics_to_shadow

__all__ = [
    "Candidate",
    "ReplyCheck",
    "RoundBound",
    "RoundRules",
    "Screened",
    "ValueCheck",
    "Verdict",
]


@dataclass(frozen=True)
class RoundRules:
    """What this round's replies must satisfy."""

    validate: Callable[[ClientReply, int | None], None]  # the round checks (override point)
    spec: PayloadSpec
    shared_sum: bool  # clients report one local scale per trainable tensor
    num_tensors: int
    model: nn.Module
    batchnorm: Mapping[str, _BatchNorm]
    scale_bound: ScaleBound
    code_scales: dict[str, float] | None
    scale_floors: dict[str, float] | None = None  # smallest bound per tensor (None: 0)
    statistics_bound: float = 0.0  # BatchNorm statistics within k shadow deviations (0: off)


@dataclass
class Candidate:
    """A reply going through the checks: what they found so far."""

    reply: ClientReply
    expected_version: int | None
    message: OpenedMessage | None = None
    statistics: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Screened:
    """A reply that passed the reply checks: its opened payload, the tensors to clip
    (name → bound) and its checked BatchNorm statistics."""

    reply: ClientReply
    message: OpenedMessage
    clip: dict[str, float]
    statistics: dict[str, torch.Tensor] | None = None

    @property
    def entries(self) -> list[EntryHeader]:
        """The payload's entries, in message order."""
        return self.message.entries


@dataclass
class Verdict:
    """A round bound's findings, by node: replies to drop, notes of clipped replies, and the
    tensors to clip (name → bound)."""

    dropped: dict[int, str] = field(default_factory=dict)
    clipped: dict[int, str] = field(default_factory=dict)
    clip: dict[int, dict[str, float]] = field(default_factory=dict)


ReplyCheck = Callable[[Candidate, RoundRules], None]
RoundBound = Callable[[list[Screened], RoundRules], Verdict]
#: (screened reply, decoded values, scales of ternary entries, peaks of dense entries)
ValueCheck = Callable[[Screened, dict[str, torch.Tensor], dict[str, float], dict[str, float]], None]


# ------------------------------------------------------------------ reply checks
def check_round(candidate: Candidate, rules: RoundRules) -> None:
    """Asked this round, version and fingerprint (:meth:`ReplicaServer.validate_reply`)."""
    rules.validate(candidate.reply, candidate.expected_version)


def check_versions(
    reply: ClientReply, expected_version: int | None, fingerprints: Mapping[int, str]
) -> None:
    """The default round checks: the node was asked (``expected_version`` not None), does
    not ask to resync, is at ``expected_version`` with that version's fingerprint."""
    node = reply.node_id
    if expected_version is None:
        raise UnexpectedReply(f"node {node} was not sent a message this round or already replied")
    if reply.resync:
        raise ResyncRequest(f"node {node} asks to resync from version {reply.model_version}")
    if reply.model_version != expected_version:
        raise VersionMismatch(
            f"node {node} is at version {reply.model_version}, expected {expected_version}"
        )
    want = fingerprints.get(expected_version)
    if want is not None and reply.fingerprint != fingerprint_prefix(want).hex():
        raise FingerprintMismatch(f"node {node} fingerprint mismatch at version {expected_version}")


def check_header(candidate: Candidate, rules: RoundRules) -> None:
    """The payload's header fits the model and the round's compressor (:mod:`screening`)."""
    reply = candidate.reply
    if reply.payload is None:
        raise PayloadRejected(f"node {reply.node_id} payload rejected: no payload")
    candidate.message = rules.spec.check(reply.payload, reply.node_id)


def check_local_scales(candidate: Candidate, rules: RoundRules) -> None:
    """Local scales, when the shared-scale sum asks for them, are one per trainable tensor."""
    reply = candidate.reply
    if reply.scales is not None and rules.shared_sum and reply.scales.shape != (rules.num_tensors,):
        raise PayloadRejected(
            f"node {reply.node_id} payload rejected: {tuple(reply.scales.shape)} local "
            f"scales for {rules.num_tensors} tensors"
        )


def check_statistics_of(candidate: Candidate, rules: RoundRules) -> None:
    """BatchNorm statistics present iff the model has BatchNorm, bounded in size, shaped
    like the model's and within the limits of :mod:`fedddl.sync.statistics_bound`."""
    reply = candidate.reply
    what = f"node {reply.node_id} statistics rejected"
    layers = rules.batchnorm
    if not layers:
        if reply.statistics is not None:
            raise PayloadRejected(f"{what}: the model has no BatchNorm layer")
        return
    if reply.statistics is None:
        raise PayloadRejected(f"{what}: the model has BatchNorm layers but none came")
    try:
        statistics = decode_update(
            reply.statistics, max_bytes=statistics_max_bytes(layers), max_tensors=3 * len(layers)
        )
        check_statistics(rules.model, statistics, layers=layers)
        check_statistics_range(statistics)
    except (PayloadError, StatisticsError) as err:
        raise PayloadRejected(f"{what}: {err}") from err
    candidate.statistics = statistics


def statistics_max_bytes(layers: Mapping[str, _BatchNorm]) -> int:
    """Largest acceptable statistics message: per layer three entries (name, header of at
    most 32 bytes) holding ``2 × channels + 1`` values of at most 8 bytes."""
    return 64 + sum(
        3 * (len(name.encode("utf-8")) + 8 + 32) + 8 * (2 * module.num_features + 1)
        for name, module in layers.items()
    )


# ------------------------------------------------------------------ round bounds
def bound_scales(screened: list[Screened], rules: RoundRules) -> Verdict:
    """Header scales within the scale bound of the round's honest majority (:mod:`scale_bound`)."""
    found = rules.scale_bound.screen(
        {item.reply.node_id: item.entries for item in screened},
        rules.code_scales,
        rules.scale_floors,
    )
    return Verdict(dict(found.dropped), dict(found.clipped), dict(found.clip))


def bound_statistics_values(screened: list[Screened], rules: RoundRules) -> Verdict:
    """BatchNorm statistics within the same factor of the round's median (clipped in place)."""
    if not rules.scale_bound.enabled:
        return Verdict()
    stats = {i.reply.node_id: i.statistics for i in screened if i.statistics is not None}
    return Verdict(clipped=bound_statistics(stats, rules.scale_bound.factor))


def bound_statistics_to_shadow_values(screened: list[Screened], rules: RoundRules) -> Verdict:
    """BatchNorm statistics within ``statistics_bound`` standard deviations of the shadow's
    running statistics (:mod:`fedddl.sync.statistics_shadow`; clipped in place)."""
    stats = {i.reply.node_id: i.statistics for i in screened if i.statistics is not None}
    return Verdict(
        clipped=bound_statistics_to_shadow(stats, rules.batchnorm, rules.statistics_bound)
    )


# ------------------------------------------------------------------ value checks
def apply_clip(
    item: Screened,
    values: dict[str, torch.Tensor],
    scales: dict[str, float],
    peaks: dict[str, float],
) -> None:
    """Clip the tensors the round bounds chose: ternary ones to ``bound × code``, dense ones
    to ``±bound``."""
    for name, bound in item.clip.items():
        if name in scales:
            scales[name] = _clip_ternary(values[name], bound)
        else:
            values[name].clamp_(-bound, bound)
            if name in peaks:
                peaks[name] = min(peaks[name], bound)


def check_finite(
    item: Screened,
    values: dict[str, torch.Tensor],
    scales: dict[str, float],
    peaks: dict[str, float],
) -> None:
    """No non-finite value in a tensor the header does not vouch for (a ternary entry is
    ``{-1, 0, 1} ×`` a finite scale; a dense entry with a measured peak stays finite)."""
    for entry in item.entries:
        name = entry.name
        if name in scales or name in peaks:
            continue
        if not bool(torch.isfinite(values[name]).all()):
            raise ReplicaError(f"update {name!r} has non-finite values")


def dense_peaks(entries: list[EntryHeader]) -> dict[str, float]:
    """The measured largest magnitudes of the dense entries that float32 decoding keeps
    (float32 / float16 / bfloat16; float64 values may round up or overflow)."""
    return {
        e.name: e.peak
        for e in entries
        if e.codec is None and e.peak is not None and e.dtype != torch.float64
    }


def bucket_peaks(entries: list[EntryHeader]) -> dict[str, float]:
    """The largest magnitudes of the ternary entries with scale buckets: their largest
    bucket scale (each value is ``s_b × code``, ``s_b <=`` it)."""
    return {e.name: e.scale for e in entries if e.codec is not None and e.bucket}


def _clip_ternary(values: torch.Tensor, bound: float) -> float:
    """Make decoded ternary ``values`` exactly ``bound × code`` (in place); return the scale."""
    scale = float(np.float32(bound))
    with torch.no_grad():
        torch.sign(values, out=values)
        values.mul_(scale)
    return scale
