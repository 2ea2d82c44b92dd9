"""Clip each reply's tensors to the round's median norm (norm clipping to the median).

The scale bound and its cap (:mod:`fedddl.sync.scale_bound`) read one number per tensor from
the header, the largest scale; a reply that passes them may still weigh several honest
clients (every value at the cap, or every bucket of a bucketed tensor raised to the
tensor's largest). :class:`NormClip` bounds what is aggregated instead: per tensor, a
reply whose L2 norm is above ``factor ×`` the lower median of the round's norms of that
tensor is scaled down to it, so one reply moves each tensor of the mean at most
``factor ×`` as far as the median reply does. The reply keeps its direction; each clip
names the tensors and the factor applied.

``factor = 0`` disables it (contributions stream through untouched). The server does not
clip with the ``shared-scale-sum`` downlink: there every admitted value is already at the
shared scale the server chose (and the direction check's density limit bounds the count of
non-zero values), and a scaled reply would no longer sum exactly in codes. Memory: one float32
copy of every contribution (as the direction check's; none more when the contributions
are already copies).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from fedddl.sync.aggregation import Contribution
from fedddl.sync.scale_bound import lower_median
from fedddl.sync.warn_once import WarnOnce

__all__ = ["NormClip"]


class NormClip:
    """Scale each reply's tensors down to ``factor ×`` the round's median norm.

    Parameters
    ----------
    factor : float
        The largest norm of a tensor, as a multiple of the lower median of the round's
        norms of it (0: off; else >= 1).
    min_replies : int
        Fewer replies than this in a round: nothing is clipped.

    Attributes
    ----------
    clipped : dict[int, str]
        This round's clipped nodes and what was clipped (once :meth:`filter`'s iterator is
        exhausted).
    """

    def __init__(self, factor: float = 0.0, min_replies: int = 3) -> None:
        if not (factor == 0 or 1 <= factor < math.inf):
            raise ValueError(f"norm-clip must be 0 (off) or >= 1, got {factor}")
        self.factor = float(factor)
        self.min_replies = min_replies
        self.clipped: dict[int, str] = {}
        self._warn_once = WarnOnce()  # nodes already logged at WARNING

    @property
    def enabled(self) -> bool:
        """Whether the clip is on."""
        return self.factor > 0

    def log_level(self, node: int) -> int:
        """The level to log ``node``'s clip at: WARNING the first time, DEBUG after."""
        return self._warn_once.level(node)

    def filter(
        self, contributions: Iterable[Contribution], copied: bool = False
    ) -> Iterator[Contribution]:
        """The contributions, each tensor over its limit scaled down (``copied``: the
        contributions are already the caller's copies, which are then scaled in place)."""
        self.clipped = {}
        if not self.enabled:
            yield from contributions
            return
        kept = [c if copied else c.copied() for c in contributions]
        if len(kept) >= self.min_replies:
            norms = {name: [_norm(c.gradient[name]) for c in kept] for name in kept[0].gradient}
            limits = {name: self.factor * lower_median(found) for name, found in norms.items()}
            for index, contribution in enumerate(kept):
                ratios = {
                    name: limits[name] / found[index]
                    for name, found in norms.items()
                    if found[index] > limits[name]
                }
                if ratios:
                    kept[index] = self._clipped(contribution, ratios)
        yield from kept

    def _clipped(self, contribution: Contribution, ratios: dict[str, float]) -> Contribution:
        """``contribution`` with each tensor of ``ratios`` scaled (in place) by its ratio."""
        scales = None if contribution.scales is None else dict(contribution.scales)
        peaks = None if contribution.peaks is None else dict(contribution.peaks)
        for name, ratio in ratios.items():
            contribution.gradient[name].mul_(ratio)
            for known in (scales, peaks):
                if known is not None and name in known:
                    known[name] *= ratio
        node = contribution.reply.node_id
        notes = ", ".join(f"{name} x{ratio:.3g}" for name, ratio in ratios.items())
        self.clipped[node] = (
            f"node {node}: norm over {self.factor:g} x the round's median, scaled: {notes}"
        )
        return Contribution(
            contribution.reply,
            contribution.gradient,
            scales=scales,
            statistics=contribution.statistics,
            peaks=peaks,
        )


def _norm(values: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(values.to(torch.float64)))
