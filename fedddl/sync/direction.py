"""Leave out replies whose direction opposes the round's majority (a direction check).

A reply at an honest scale whose signs are set against the honest gradient (a sign flip,
a negated gradient just under the scale bound) weighs as much as an honest client and
cancels one: no scale bound can tell it apart. Its *direction* can: per coordinate, the
honest majority's signs agree with each other, so an honest reply's signs agree with the
others' vote more often than they disagree, and an opposed reply's disagree.

:class:`DirectionCheck` copies the round's contributions, then for each reply ``i``:

* ``vote_-i`` = per coordinate, the sign of the sum of the *other* replies' signs
  (every tensor, flattened; a leave-one-out signSGD majority vote, so a reply cannot vote
  for itself);
* ``alignment_i`` = ``Σ sign(x_i) · vote_-i / nnz(x_i)``, in ``[-1, 1]``: the share of its
  non-zero values that agree with the others' vote minus the share that disagree
  (0 for an all-zero reply);
* the reply is **dropped** when ``alignment_i < fraction × m``, where ``m`` is the lower
  median of the round's alignments; nothing is dropped for its direction when ``m <= 0``
  (no majority direction to judge by); with a ``noise`` margin ``z > 0``, also only when
  ``m - alignment_i > z / sqrt(nnz(x_i))`` (``1 / sqrt(nnz)`` is the spread of the
  alignment of a reply whose signs are independent of the vote: late in training honest
  replies' alignments come within that spread of 0, and a reply within noise of the
  median is not judged opposed);
* the reply is also **dropped** when it has more than ``density ×`` the lower median
  number of non-zero values of the round's replies (honest ternary replies of one round
  have similar densities; a reply of all ±1 codes would weigh several honest ones and
  could buy agreement with many coordinates);
* nothing is judged when fewer than ``min_replies`` replies arrived.

The kept contributions go on to the aggregator unchanged, in their order. Memory: one
float32 copy of every contribution (``n ×`` the model, as the median's), plus an int32
vote. ``fraction = 0`` disables both checks (contributions stream through untouched).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from fedddl.sync.aggregation import Contribution
from fedddl.sync.scale_bound import lower_median
from fedddl.sync.warn_once import WarnOnce

__all__ = [
    "DENSITY_FACTOR",
    "DirectionCheck",
    "DirectionVerdict",
    "alignments",
    "flat_signs",
    "judge",
]

#: A reply with more than this multiple of the round's median count of non-zero values is
#: dropped (honest ternary replies of one round have similar counts).
DENSITY_FACTOR = 2.0


@dataclass(frozen=True)
class DirectionVerdict:
    """One reply's direction check: its alignment and, if dropped, why."""

    node_id: int
    alignment: float
    reason: str = ""


def alignments(signs: list[torch.Tensor]) -> list[float]:
    """Each flat sign vector's alignment with the leave-one-out vote of the others.

    Parameters
    ----------
    signs : list[torch.Tensor]
        One flat int8 tensor of -1/0/+1 per reply, all of one length.

    Returns
    -------
    list[float]
        ``Σ s_i · sign(Σ_{j≠i} s_j) / max(1, nnz(s_i))``, per reply.
    """
    if not signs:
        return []
    vote = torch.zeros(signs[0].numel(), dtype=torch.int32)
    for s in signs:
        vote += s.to(torch.int32)
    out: list[float] = []
    for s in signs:
        wide = s.to(torch.int32)
        others = torch.sign(vote - wide)
        nonzero = int(torch.count_nonzero(wide))
        out.append(float(torch.sum(wide * others)) / max(1, nonzero))
    return out


class DirectionCheck:
    """Drop replies opposed to the others' majority direction (see the module docstring).

    Parameters
    ----------
    fraction : float
        A reply is dropped below ``fraction ×`` the round's median alignment; 0 disables
        the check.
    min_replies : int
        Fewer replies than this in a round: nothing is judged.
    density : float
        A reply with more than this multiple of the round's median count of non-zero
        values is dropped (0: no density check).
    noise : float
        A reply is dropped for its direction only when its alignment also lies more than
        ``noise / sqrt(nnz)`` below the median (0: no margin).
    """

    def __init__(
        self,
        fraction: float = 0.0,
        min_replies: int = 3,
        density: float = DENSITY_FACTOR,
        noise: float = 0.0,
    ) -> None:
        if not (0 <= fraction <= 1) or math.isnan(fraction):
            raise ValueError(f"direction-check must be in [0, 1], got {fraction}")
        if min_replies < 2:
            raise ValueError(f"min_replies must be >= 2, got {min_replies}")
        if not (density == 0 or 1 <= density < math.inf):
            raise ValueError(f"density must be 0 (off) or >= 1, got {density}")
        self.fraction = float(fraction)
        self.min_replies = min_replies
        if not (0 <= noise < math.inf):
            raise ValueError(f"noise must be finite and >= 0, got {noise}")
        self.density = float(density)
        self.noise = float(noise)
        self.verdicts: list[DirectionVerdict] = []
        self._warn_once = WarnOnce()  # nodes already logged at WARNING

    @property
    def enabled(self) -> bool:
        """Whether the check is on."""
        return self.fraction > 0

    def filter(self, contributions: Iterable[Contribution]) -> Iterator[Contribution]:
        """The contributions that pass (copies, in order); :attr:`verdicts` holds this
        round's alignments and reasons once the iterator is exhausted."""
        self.verdicts = []
        if not self.enabled:
            yield from contributions
            return
        kept = [c.copied() for c in contributions]
        self.screen([(c.reply.node_id, c.gradient) for c in kept])
        for contribution, verdict in zip(kept, self.verdicts, strict=True):
            if not verdict.reason:
                yield contribution

    def screen(
        self, replies: Sequence[tuple[int, Mapping[str, torch.Tensor]]]
    ) -> list[DirectionVerdict]:
        """This round's verdicts on ``(node, tensors)`` pairs, in order (also kept in
        :attr:`verdicts`); none is dropped when the check is off or fewer than
        ``min_replies`` replies came."""
        if not self.enabled or len(replies) < self.min_replies:
            self.verdicts = [DirectionVerdict(node, 0.0) for node, _ in replies]
        else:
            signs = [flat_signs(tensors) for _, tensors in replies]
            nodes = [node for node, _ in replies]
            self.verdicts = judge(nodes, signs, self.fraction, self.density, self.noise)
        return self.verdicts

    def log_level(self, node: int) -> int:
        """The level to log ``node``'s drop at: WARNING the first time, DEBUG after."""
        return self._warn_once.level(node)


def flat_signs(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The signs of every tensor of one reply, flattened into one int8 vector."""
    return torch.cat([torch.sign(v.reshape(-1)).to(torch.int8) for v in tensors.values()])


def judge(
    nodes: Sequence[int],
    signs: Sequence[torch.Tensor],
    fraction: float,
    density: float,
    noise: float = 0.0,
) -> list[DirectionVerdict]:
    """Each reply's verdict (see the module docstring): its alignment, and a reason when it
    is dropped for its direction (``fraction``, beyond the ``noise`` margin) or its non-zero
    count (``density``)."""
    found = alignments(list(signs))
    median = lower_median(found)
    limit = fraction * median
    counts = [int(torch.count_nonzero(s)) for s in signs]
    most = density * lower_median(counts) if density else math.inf
    verdicts = []
    for node, alignment, count in zip(nodes, found, counts, strict=True):
        reason = ""
        if count > most:
            reason = (
                f"node {node}: {count} non-zero values, more than {density:g} x the "
                f"round's median {lower_median(counts)}: dropped"
            )
        elif median > 0 and alignment < limit and median - alignment > noise / math.sqrt(
            max(count, 1)
        ):
            reason = (
                f"node {node}: direction opposes the round's majority: alignment "
                f"{alignment:.3f} < {fraction:g} x the median {median:.3f}: dropped"
            )
        verdicts.append(DirectionVerdict(node, alignment, reason))
    return verdicts
