"""Combining the accepted gradients of a round, one reply at a time.

The server decodes each accepted reply into one reused buffer and hands it to the
aggregation as a :class:`Contribution`; :func:`running_mean` adds it to a float32
accumulator, so server memory does not grow with the number of clients. When the
round's downlink is ``shared-scale-sum`` it also sums the replies' ternary codes (exact
integers), which :func:`fedddl.compression.codecs.downlink.encode_shared_sum` sends without a
second quantisation.

A robust variant (a median, say) needs every gradient at once: it must copy each
contribution, because the buffer is overwritten by the next reply (the robust aggregators
of :mod:`fedddl.sync.robust` do).

Overflow: a float32 sum of finite gradients overflows once it passes ``3.4e38``. Each
contribution carries (or :func:`running_mean` measures) the largest magnitude of each of its
tensors; while their running sum stays below ``1e38`` the float32 accumulator cannot
overflow and is used as is (every ordinary mean is unchanged, bit for bit); a tensor whose
magnitudes could add up past it is accumulated in float64 from then on, and its mean, which
is at most the largest magnitude, is cast back to float32.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from fedddl.compression.codecs.downlink import ternary_codes
from fedddl.running_stats import StatisticsPool
from fedddl.sync.messages import ClientReply

__all__ = ["FLOAT32_SAFE_SUM", "Aggregate", "Contribution", "running_mean"]

#: A float32 sum of values whose magnitudes add up to less than this cannot overflow.
FLOAT32_SAFE_SUM = 1e38


@dataclass(frozen=True)
class Contribution:
    """One accepted reply and its decoded gradient.

    Attributes
    ----------
    reply : ClientReply
        The parsed, validated reply.
    gradient : Mapping[str, torch.Tensor]
        The decoded (pseudo-)gradient by parameter name, float32. A buffer owned by the
        server and overwritten by the next contribution: copy what you keep.
    scales : Mapping[str, float] | None
        The ternary scale of each tensor that has one (after any clipping): every value of
        that tensor is ``-scale``, 0 or ``scale``. Tensors without one are dense.
    statistics : Mapping[str, torch.Tensor] | None
        The reply's checked BatchNorm input statistics (:mod:`fedddl.running_stats`);
        None for models without BatchNorm.
    peaks : Mapping[str, float] | None
        Known largest magnitudes of dense tensors (measured when the payload was screened);
        a dense tensor without one is measured when needed.
    """

    reply: ClientReply
    gradient: Mapping[str, torch.Tensor]
    scales: Mapping[str, float] | None = None
    statistics: Mapping[str, torch.Tensor] | None = None
    peaks: Mapping[str, float] | None = None

    def copied(self) -> Contribution:
        """This contribution with its gradient copied out of the shared decode buffer."""
        gradient = {k: v.clone() for k, v in self.gradient.items()}
        return Contribution(self.reply, gradient, scales=self.scales,
                            statistics=self.statistics, peaks=self.peaks)

    def peak(self, name: str) -> float:
        """The largest magnitude of tensor ``name`` (its scale, its known peak, or measured)."""
        known = None if self.scales is None else self.scales.get(name)
        if known is None and self.peaks is not None:
            known = self.peaks.get(name)
        if known is not None:
            return float(known)
        values = self.gradient[name]
        return float(values.abs().max()) if values.numel() else 0.0


@dataclass
class Aggregate:
    """The result of a round's aggregation.

    Attributes
    ----------
    gradient : dict[str, torch.Tensor]
        The combined gradient every replica applies (after downlink encoding).
    contributors : list[ClientReply]
        The replies that went into it, in the order they were combined (the partitions
        the clients report, then node id).
    code_sums : dict[str, torch.Tensor] | None
        Exact sums of the contributors' ternary codes (int32, flat) at the shared scales,
        when every contribution was ternary at those scales; else None.
    statistics : dict[str, torch.Tensor] | None
        The contributors' pooled BatchNorm statistics (None: no BatchNorm).
    """

    gradient: dict[str, torch.Tensor]
    contributors: list[ClientReply] = field(default_factory=list)
    code_sums: dict[str, torch.Tensor] | None = None
    statistics: dict[str, torch.Tensor] | None = None


def running_mean(
    contributions: Iterable[Contribution], code_scales: Mapping[str, float] | None = None
) -> Aggregate:
    """Element-wise mean of the contributions in float32, accumulated in the order given.

    Parameters
    ----------
    contributions : Iterable[Contribution]
        The round's accepted replies (consumed once).
    code_scales : Mapping[str, float] | None
        Shared per-tensor scales: also sum the ternary codes at these scales, as long as
        every contribution is exactly ternary at them.

    Returns
    -------
    Aggregate
        With an empty ``gradient`` when there was no contribution.
    """
    total: dict[str, torch.Tensor] = {}
    wide: dict[str, torch.Tensor] = {}  # float64 accumulators of tensors that could overflow
    reach: dict[str, float] = {}  # sum of the contributions' largest magnitudes, per tensor
    sums: dict[str, torch.Tensor] | None = None
    pool: StatisticsPool | None = None
    contributors: list[ClientReply] = []
    for contribution in contributions:
        gradient = contribution.gradient
        if not contributors:
            total = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in gradient.items()}
            reach = dict.fromkeys(total, 0.0)
            if code_scales is not None:
                sums = {
                    k: torch.zeros(v.numel(), dtype=torch.int32)
                    for k, v in gradient.items()
                    if k in code_scales
                }
        for name, acc in total.items():
            values = gradient[name]
            reach[name] += contribution.peak(name)
            if name in wide:
                wide[name] += values.to(torch.float64)
            elif reach[name] > FLOAT32_SAFE_SUM:
                wide[name] = acc.to(torch.float64) + values.to(torch.float64)
            else:
                acc += values.to(torch.float32)
        if sums is not None and code_scales is not None:
            sums = _add_codes(sums, gradient, code_scales)
        if contribution.statistics is not None:
            pool = pool or StatisticsPool(robust=True)
            pool.add(contribution.statistics)
        contributors.append(contribution.reply)
    if not contributors:
        return Aggregate({})
    count = len(contributors)
    mean = {
        name: (wide[name] / count).to(torch.float32) if name in wide else acc / count
        for name, acc in total.items()
    }
    return Aggregate(mean, contributors, sums, None if pool is None else pool.result())


def _add_codes(
    sums: dict[str, torch.Tensor],
    gradient: Mapping[str, torch.Tensor],
    scales: Mapping[str, float],
) -> dict[str, torch.Tensor] | None:
    """Add ``gradient``'s ternary codes to ``sums``; None if it is not ternary at ``scales``."""
    codes: dict[str, torch.Tensor] = {}
    for name in sums:
        found = ternary_codes(gradient[name], scales[name])
        if found is None:
            return None
        codes[name] = found
    for name, total in sums.items():
        total += codes[name].to(torch.int32)
    return sums
