"""BatchNorm statistics bounded relative to the server shadow's own running statistics.

:func:`fedddl.sync.statistics_bound.bound_statistics` clips a reply's statistics to the
round's majority; a round whose replies mostly come from attackers (few clients, sampled
clients) still sets that majority. This bound compares each reply with what the shadow
replica already holds instead. Per BatchNorm layer and channel, with ``k`` the factor,
``μ`` and ``σ²`` the shadow's running mean and variance without the bias of their start
values (:func:`shadow_reference`):

* ``mean`` is clipped to ``μ ± k · sqrt(σ² + eps)``;
* ``var`` is clipped to ``[σ² / k², k² · (σ² + eps)]``.

A layer whose running statistics have not moved yet (``num_batches_tracked == 0``: the
first round) is not bounded: its running statistics are BatchNorm's start values, not
anything the clients reported. ``count`` is left to the round bound.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from fedddl.running_stats import MEAN, VAR

__all__ = ["bound_statistics_to_shadow", "shadow_reference"]


def shadow_reference(layer: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The layer's running mean and variance (float64, CPU) without their start values'
    bias; None if the layer has not tracked a batch yet.

    BatchNorm starts from mean 0 and variance 1 and moves them by a momentum ``m``; after
    ``t`` batches a share ``(1 − m)^t`` of each is still the start value, which this removes
    (as Adam corrects its moments): ``μ = running_mean / (1 − (1 − m)^t)``,
    ``σ² = (running_var − (1 − m)^t) / (1 − (1 − m)^t)``, clamped at 0. A cumulative
    average (``momentum=None``) keeps no start value.
    """
    tracked = layer.num_batches_tracked
    mean, var = layer.running_mean, layer.running_var
    if tracked is None or mean is None or var is None or int(tracked) < 1:
        return None
    steps = int(tracked)
    keep = 0.0 if layer.momentum is None else (1.0 - float(layer.momentum)) ** steps
    with torch.no_grad():
        mean64 = mean.detach().to("cpu", torch.float64)
        var64 = var.detach().to("cpu", torch.float64)
        if keep <= 0.0:
            return mean64, var64.clamp_min(0.0)
        if keep >= 1.0:  # momentum 0: the start values never move
            return None
        return mean64 / (1.0 - keep), ((var64 - keep) / (1.0 - keep)).clamp_min(0.0)


def bound_statistics_to_shadow(
    per_node: Mapping[int, dict[str, torch.Tensor]],
    layers: Mapping[str, _BatchNorm],
    factor: float,
) -> dict[int, str]:
    """Clip each node's statistics to ``factor`` standard deviations of the shadow's, in place.

    Parameters
    ----------
    per_node : Mapping[int, dict[str, torch.Tensor]]
        Node → its checked statistics (``"<layer>.mean"``, ``"<layer>.var"``, ...), changed
        in place when clipped.
    layers : Mapping[str, _BatchNorm]
        The shadow's BatchNorm layers by name (their running statistics are the reference).
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
    for name, layer in layers.items():
        reference = shadow_reference(layer)
        if reference is None:
            continue
        mu, sigma2 = reference
        spread = factor * (sigma2 + layer.eps).sqrt()
        limits = {
            MEAN: (mu - spread, mu + spread),
            VAR: (sigma2 / (factor * factor), factor * factor * (sigma2 + layer.eps)),
        }
        for part, (low, high) in limits.items():
            key = f"{name}.{part}"
            for node, stats in per_node.items():
                value = stats.get(key)
                if value is None:
                    continue
                lo, hi = low.to(value.device, value.dtype), high.to(value.device, value.dtype)
                outside = (value < lo) | (value > hi)
                if not bool(outside.any()):
                    continue
                index = int(outside.nonzero()[0, 0])
                reasons.setdefault(
                    node,
                    f"node {node}: statistics {key!r} {float(value[index]):.4g} (channel "
                    f"{index}) outside the shadow's bound [{float(lo[index]):.4g}, "
                    f"{float(hi[index]):.4g}]",
                )
                stats[key] = torch.minimum(torch.maximum(value, lo), hi)
    return reasons
