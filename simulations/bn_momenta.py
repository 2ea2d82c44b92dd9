"""Running statistics a run would have with other BatchNorm momenta, on the same weights.

A replica's weights never depend on its BatchNorm running statistics (gradients use batch
statistics), and every replica moves its running statistics by the round's pooled statistics
(:func:`fedddl.running_stats.apply_statistics`). So one run can also keep, for each other
momentum ``m``, a side copy of the model whose running statistics follow the same pooled
statistics with momentum ``m``: the running statistics a run with ``bn-momentum = m`` would
have at the same round. :class:`SideMomenta` does that for the ``fedddl simulate`` run of
:mod:`simulations.bn_lag` (``--momenta``).

Each round's pooled statistics are applied by the server's shadow first and by each client's
replica later (the same values); a side copy applies each distinct statistics update once,
in the order first seen.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fedddl.models import with_bn_momentum

__all__ = ["SideMomenta", "digest"]

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def digest(stats: Mapping[str, torch.Tensor]) -> str:
    """A content hash of one statistics update (names and values)."""
    h = hashlib.sha256()
    for name in sorted(stats):
        h.update(name.encode())
        h.update(stats[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class SideMomenta:
    """Side copies of a model whose running statistics follow a run's pooled statistics with
    other momenta.

    :meth:`wrap` returns an ``apply_statistics`` that also feeds the side copies; the first
    call copies the model it is given (its running statistics as they stand then, the
    initial ones) as the side copies' start.
    """

    def __init__(self, momenta: list[float]) -> None:
        if any(not 0 < m <= 1 for m in momenta):
            raise ValueError(f"momenta must be in (0, 1], got {momenta}")
        self.momenta = list(momenta)
        self.sides: dict[float, nn.Module] = {}
        self.seen: set[str] = set()
        self.updates = 0

    def wrap(self, apply: Callable[..., None]) -> Callable[..., None]:
        """``apply`` (``apply_statistics(model, stats, **kw)``) that also feeds the sides."""

        def apply_and_follow(
            model: nn.Module, stats: Mapping[str, torch.Tensor], **kw: Any
        ) -> None:
            if not self.sides:
                for m in self.momenta:
                    self.sides[m] = with_bn_momentum(copy.deepcopy(model), m)
            key = digest(stats)
            if key not in self.seen:
                self.seen.add(key)
                self.updates += 1
                frozen = {k: v.detach().clone() for k, v in stats.items()}
                for side in self.sides.values():
                    apply(side, frozen)
            apply(model, stats, **kw)

        return apply_and_follow

    def with_statistics_of(self, model: nn.Module, momentum: float) -> nn.Module:
        """A copy of ``model`` (the run's weights) with the side copy's running statistics for
        ``momentum``; ``model`` itself when nothing was applied yet."""
        side = self.sides.get(momentum)
        if side is None:
            return model
        out = copy.deepcopy(model)
        buffers = dict(side.named_buffers())
        with torch.no_grad():
            for name, buffer in out.named_buffers():
                if name.rsplit(".", 1)[-1] in _BUFFERS:
                    buffer.copy_(buffers[name])
        return out
