"""Screening of the BatchNorm statistics a reply carries (:mod:`fedddl.running_stats`).

A client of a model with BatchNorm layers sends, next to its gradient, the per-channel
mean, (biased) variance and count of its layers' inputs; the server pools them with
coordinate-wise medians and every replica moves its running statistics by the pooled
values. An attacker can send any finite numbers there, so besides
:func:`fedddl.running_stats.check_statistics` (names, shapes, finite, ``var >= 0``,
``count >= 1``) the server:

* refuses statistics beyond :data:`MAX_ABS_MEAN`, :data:`MAX_VAR` or :data:`MAX_COUNT`
  (:func:`check_statistics_range`): no honest input comes near them, and below them the
  pooling (``var + mean²`` in float64, cast to float32) and the replicas' update
  (``var · n / (n − 1)``) cannot overflow;
* with the scale bound on (factor ``k``, :mod:`fedddl.sync.scale_bound`), clips each
  reply's statistics to the round's honest majority (:func:`bound_statistics`): per layer,
  ``|mean|`` to ``k ×`` the lower median over the round's replies of their largest
  ``|mean|``, ``var`` to ``k² ×`` the lower median of their largest ``var``, and ``count`` to
  ``k ×`` the lower median count. One attacker cannot move a median of three or more
  replies, so it cannot move the pooled statistics by more than ``k / n`` of an honest
  client's magnitude;
* then bounds them relative to the shadow replica's own running statistics
  (:mod:`fedddl.sync.statistics_shadow`, ``statistics-bound``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedddl.running_stats import COUNT, MEAN, VAR, StatisticsError
from fedddl.sync.scale_bound import lower_median

__all__ = ["MAX_ABS_MEAN", "MAX_COUNT", "MAX_VAR", "bound_statistics", "check_statistics_range"]

#: Largest accepted ``|mean|`` of a BatchNorm layer's inputs.
MAX_ABS_MEAN = 1e15
#: Largest accepted variance of a BatchNorm layer's inputs.
MAX_VAR = 1e30
#: Largest accepted count of values per channel.
MAX_COUNT = 1e15

_LIMITS = {MEAN: MAX_ABS_MEAN, VAR: MAX_VAR, COUNT: MAX_COUNT}


def check_statistics_range(stats: Mapping[str, torch.Tensor]) -> None:
    """Refuse statistics (already checked to fit the model) beyond the module's limits.

    Raises
    ------
    StatisticsError
        Naming the entry and the limit.
    """
    by_part: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for key, value in stats.items():
        by_part.setdefault(key.rpartition(".")[2], []).append((key, value))
    for part, items in by_part.items():
        limit = _LIMITS.get(part)
        if limit is None or _peak([v for _, v in items]) <= limit:
            continue
        for key, value in items:  # name the first entry beyond the limit
            if value.numel() and float(value.abs().max()) > limit:
                raise StatisticsError(
                    f"statistics {key!r} reach {float(value.abs().max()):.4g}, beyond {limit:g}"
                )


def _peak(values: list[torch.Tensor]) -> float:
    """The largest magnitude over ``values`` (checked finite), in one reduction when they
    fit in one tensor."""
    try:
        flat = torch.cat([v.detach().reshape(-1) for v in values])
    except RuntimeError:  # several devices
        return max((float(v.abs().max()) for v in values if v.numel()), default=0.0)
    return float(flat.abs().max()) if flat.numel() else 0.0


def bound_statistics(
    per_node: Mapping[int, dict[str, torch.Tensor]], factor: float
) -> dict[int, str]:
    """Clip each node's statistics to ``factor`` × the round's medians, in place.

    Parameters
    ----------
    per_node : Mapping[int, dict[str, torch.Tensor]]
        Node → its checked statistics (changed in place when clipped).
    factor : float
        ``k`` (0: no bound).

    Returns
    -------
    dict[int, str]
        Node → why its statistics were clipped (the first clipped entry).
    """
    reasons: dict[int, str] = {}
    if factor <= 0 or not per_node:
        return reasons
    keys = list(next(iter(per_node.values())).keys())
    nodes = list(per_node)
    table = _peaks(per_node, nodes, keys)  # table[i][j]: peak of node i's entry j
    for j, key in enumerate(keys):
        part = key.rpartition(".")[2]
        peaks = {node: table[i][j] for i, node in enumerate(nodes)}
        reference = lower_median(list(peaks.values()))
        bound = reference * (factor * factor if part == VAR else factor)
        for node, peak in peaks.items():
            if peak <= bound:
                continue
            value = per_node[node][key]
            per_node[node][key] = value.clamp(-bound, bound) if part == MEAN else value.clamp(
                max=max(bound, 1.0) if part == COUNT else bound
            )
            reasons.setdefault(
                node, f"node {node}: statistics {key!r} {peak:.4g} exceed the bound {bound:.4g}"
            )
    return reasons


def _peaks(
    per_node: Mapping[int, dict[str, torch.Tensor]], nodes: list[int], keys: list[str]
) -> list[list[float]]:
    """Each node's largest magnitude per entry: one pass over each node's values.

    The entries have the same (checked, 1-D, non-empty) shapes at every node; anything
    else (several devices, an empty entry) is measured entry by entry.
    """
    first = per_node[nodes[0]]
    sizes = [first[key].numel() for key in keys]
    starts = np.cumsum([0, *sizes[:-1]])
    table = []
    for node in nodes:
        values = [per_node[node][key] for key in keys]
        row = None
        if min(sizes) >= 1 and [v.numel() for v in values] == sizes:
            try:
                flat = torch.cat(values).abs().cpu().numpy()
                row = np.maximum.reduceat(flat, starts).tolist()
            except (RuntimeError, TypeError):  # several devices, no numpy dtype (bfloat16)
                row = None
        if row is None:  # one by one
            row = [float(v.abs().max()) if v.numel() else 0.0 for v in values]
        table.append(row)
    return table
