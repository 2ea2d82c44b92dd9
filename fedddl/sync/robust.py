"""Robust aggregators of a round's ternary gradients, selectable by name.

Every aggregator takes the round's contributions (:class:`~fedddl.sync.aggregation.Contribution`,
each decoded into a buffer the next one overwrites) and the shared code scales of the
``shared-scale-sum`` downlink, and returns an :class:`~fedddl.sync.aggregation.Aggregate`:

``"mean"``
    :func:`~fedddl.sync.aggregation.running_mean`: streams (memory flat in the number of
    clients); with the header scale bound of :mod:`fedddl.sync.scale_bound` (on by default)
    one client's influence on a coordinate is at most ``bound / n``.
``"median"``
    Coordinate-wise median of the decoded values (the mean of the two middle values for an
    even count, as ``numpy.median`` and Flower's ``FedMedian``). Tolerates fewer than half
    bad replies, but on ternary gradients most values of a coordinate are 0, so the median
    is mostly 0 and learning is slow (see ``docs/untrusted-clients.md``).
``"trimmed-mean"``
    Coordinate-wise mean after dropping the ``⌊β n⌋`` largest and smallest values
    (``β = trim-fraction``, as Flower's ``FedTrimmedAvg``).
``"sign-vote"``
    signSGD with majority vote (Bernstein et al., 2019) on the ternary codes: per tensor,
    ``m × sign(Σ_i code_i)`` where ``code_i = sign(value_i)`` and ``m`` is the lower median
    of the contributions' scales (measured peak for dense tensors). One reply moves each
    coordinate's vote by at most one, whatever its scale. Streams like the mean (an int32
    vote per value plus one scale per tensor and reply).

Every aggregator, the mean included, pools the BatchNorm statistics with coordinate-wise
medians (:class:`fedddl.running_stats.StatisticsPool` with ``robust=True``): statistics are
as untrusted as gradients. The median and the trimmed mean keep a
float32 copy of every contribution (``n ×`` the model). Only the mean returns the
``code_sums`` of the ``shared-scale-sum`` downlink; the others' aggregate is re-encoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from fedddl.defenses import AGGREGATORS
from fedddl.running_stats import StatisticsPool
from fedddl.sync.aggregation import Aggregate, Contribution, running_mean
from fedddl.sync.messages import ClientReply
from fedddl.sync.scale_bound import lower_median

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "coordinate_median",
    "make_aggregator",
    "sign_vote",
    "trimmed_mean",
]

#: ``aggregator(contributions, code_scales) -> Aggregate``.
Aggregator = Callable[[Iterable[Contribution], Mapping[str, float] | None], Aggregate]


def _pooling(contributions: Iterable[Contribution], pool: StatisticsPool) -> Iterator[Contribution]:
    """The contributions, their BatchNorm statistics added to ``pool`` on the way."""
    for contribution in contributions:
        if contribution.statistics is not None:
            pool.add(contribution.statistics)
        yield contribution


def _pooled(pool: StatisticsPool) -> dict[str, torch.Tensor] | None:
    return pool.result() if pool.clients else None


def _stacked(
    contributions: Iterable[Contribution], pool: StatisticsPool
) -> tuple[list[ClientReply], dict[str, torch.Tensor]]:
    """Every contribution copied into one ``n × ...`` float32 tensor per name."""
    replies: list[ClientReply] = []
    copies: list[dict[str, torch.Tensor]] = []
    for contribution in _pooling(contributions, pool):
        replies.append(contribution.reply)
        copies.append({k: v.to(torch.float32, copy=True) for k, v in contribution.gradient.items()})
    if not copies:
        return replies, {}
    return replies, {name: torch.stack([c[name] for c in copies]) for name in copies[0]}


def coordinate_median(
    contributions: Iterable[Contribution], code_scales: Mapping[str, float] | None = None
) -> Aggregate:
    """Coordinate-wise median of the contributions (see the module docstring)."""
    del code_scales
    pool = StatisticsPool(robust=True)
    replies, stacked = _stacked(contributions, pool)
    if not replies:
        return Aggregate({})
    n = len(replies)
    median: dict[str, torch.Tensor] = {}
    for name, values in stacked.items():
        ordered = values.sort(dim=0).values
        median[name] = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    return Aggregate(median, replies, statistics=_pooled(pool))


def trimmed_mean(
    contributions: Iterable[Contribution],
    code_scales: Mapping[str, float] | None = None,
    *,
    trim_fraction: float = 0.2,
) -> Aggregate:
    """Coordinate-wise mean without the ``⌊trim_fraction × n⌋`` extremes on each side.

    Raises
    ------
    ValueError
        If ``trim_fraction`` is not in ``[0, 0.5)``.
    """
    del code_scales
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim-fraction must be in [0, 0.5), got {trim_fraction}")
    pool = StatisticsPool(robust=True)
    replies, stacked = _stacked(contributions, pool)
    if not replies:
        return Aggregate({})
    n = len(replies)
    cut = int(trim_fraction * n)
    mean: dict[str, torch.Tensor] = {}
    for name, values in stacked.items():
        ordered = values.sort(dim=0).values
        mean[name] = ordered[cut : n - cut].mean(dim=0)
    return Aggregate(mean, replies, statistics=_pooled(pool))


def sign_vote(
    contributions: Iterable[Contribution], code_scales: Mapping[str, float] | None = None
) -> Aggregate:
    """Majority vote on the codes, at the median scale (see the module docstring)."""
    del code_scales
    votes: dict[str, torch.Tensor] = {}
    scales: dict[str, list[float]] = {}
    shapes: dict[str, torch.Size] = {}
    replies: list[ClientReply] = []
    pool = StatisticsPool(robust=True)
    for contribution in _pooling(contributions, pool):
        gradient = contribution.gradient
        if not replies:
            votes = {k: torch.zeros(v.numel(), dtype=torch.int32) for k, v in gradient.items()}
            scales = {k: [] for k in gradient}
            shapes = {k: v.shape for k, v in gradient.items()}
        for name, vote in votes.items():
            vote += torch.sign(gradient[name].reshape(-1)).to(torch.int32)
            scales[name].append(contribution.peak(name))
        replies.append(contribution.reply)
    if not replies:
        return Aggregate({})
    result: dict[str, torch.Tensor] = {}
    for name, vote in votes.items():
        magnitude = torch.tensor(lower_median(scales[name]), dtype=torch.float32)
        result[name] = (torch.sign(vote).to(torch.float32) * magnitude).reshape(shapes[name])
    return Aggregate(result, replies, statistics=_pooled(pool))


def make_aggregator(name: str, *, trim_fraction: float = 0.2) -> Aggregator:
    """The aggregator called ``name`` (one of :data:`AGGREGATORS`).

    Raises
    ------
    ValueError
        On an unknown name or a bad ``trim_fraction``.
    """
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim-fraction must be in [0, 0.5), got {trim_fraction}")
    if name == "mean":
        return running_mean
    if name == "median":
        return coordinate_median
    if name == "trimmed-mean":

        def trimmed(
            contributions: Iterable[Contribution], code_scales: Mapping[str, float] | None
        ) -> Aggregate:
            return trimmed_mean(contributions, code_scales, trim_fraction=trim_fraction)

        return trimmed
    if name == "sign-vote":
        return sign_vote
    raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {name!r}")
