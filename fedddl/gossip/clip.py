"""Clipped gossip: how far one neighbour's model may pull a node's own.

A node merges ``x + w * clip(d)`` instead of ``x + w * d``, where ``d`` is the
neighbour's difference to it (``received - own``, or with compressed gossip the
difference of the two public copies of an edge update) and ``clip`` scales ``d``
down to the norm ``tau`` when it is longer (ClippedGossip, He, Karimireddy and
Jaggi 2022; centred clipping around the node's own model):

* ``tau = multiplier * median`` of the peers' *recent difference norms*: for every
  peer the norm of its last difference as received. Each peer, honest or not, has
  one vote, so a minority of compromised peers cannot move the median far.
* **Warm-up**, while fewer than ``min_voters`` (3) peers have voted -- for good
  with fewer peers, as a median of one or two votes protects nothing: ``tau =
  multiplier * ||x - x0||``, the node's own drift from the shared initial model
  (honest nodes that started there and trained as long are about as far apart);
  before the node's first step that bound is 0 and nothing is merged.

Every clipped difference is reported with a reason: ``"clip-warm-up"`` (warm-up
bound), ``"clip"`` (over ``tau``), ``"clip-far"`` (over ``far_factor`` times the
median or the drift: no honest spread looks like that; logged at WARNING, the
others at INFO).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_CLIP",
    "ClipOutcome",
    "MergeClip",
    "clip_level",
    "difference",
    "state_norm",
]

#: Default ``multiplier`` of the clip (``tau = multiplier * median recent norm``; 0 = off).
DEFAULT_CLIP = 0.25
#: Differences longer than this many times the reference norm (``tau / multiplier``) are
#: reported as ``"clip-far"``.
DEFAULT_FAR_FACTOR = 5.0
#: Peers that must have voted before the median replaces the warm-up bound.
DEFAULT_MIN_VOTERS = 3


@dataclass(frozen=True)
class ClipOutcome:
    """What :meth:`MergeClip.clip` did to one difference.

    Attributes
    ----------
    update : dict[str, torch.Tensor]
        The (possibly scaled down) update to apply.
    norm : float
        Norm of the difference as received.
    bound : float
        The bound it was held to (``inf`` when nothing bounds it yet).
    reason : str or None
        ``None`` when it was applied as is, else the clip's reason category.
    """

    update: dict[str, torch.Tensor]
    norm: float
    bound: float
    reason: str | None


def state_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """L2 norm over every floating-point tensor (per tensor in its dtype, summed in float64)."""
    total = 0.0
    for tensor in tensors.values():
        if tensor.is_floating_point() and tensor.numel():
            total += float(torch.linalg.vector_norm(tensor)) ** 2
    return math.sqrt(total)


def difference(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``a - b`` for the floating-point tensors of ``a``."""
    return {k: a[k] - b[k] for k, v in a.items() if v.is_floating_point()}


def clip_level(reason: str) -> int:
    """Log level of a clip's first report: WARNING for ``"clip-far"``, else INFO."""
    return logging.WARNING if reason == "clip-far" else logging.INFO


class MergeClip:
    """One node's clip of its neighbours' differences (see the module docstring).

    Parameters
    ----------
    multiplier : float
        ``tau = multiplier * reference``; ``> 0`` (a node without clipping has no
        ``MergeClip``).
    initial : Mapping[str, torch.Tensor]
        The shared initial model (for the warm-up bound).
    min_voters : int
        Peers with a recorded norm needed before the median is used.
    far_factor : float
        Multiple of the reference norm (the median, or the drift during the
        warm-up) beyond which a clip is reported as ``"clip-far"``.

    Thread-safe.
    """

    def __init__(
        self,
        multiplier: float,
        initial: Mapping[str, torch.Tensor],
        *,
        min_voters: int = DEFAULT_MIN_VOTERS,
        far_factor: float = DEFAULT_FAR_FACTOR,
    ) -> None:
        if not multiplier > 0 or not math.isfinite(multiplier):
            raise ValueError(f"clip multiplier must be finite and > 0, got {multiplier}")
        if min_voters < 1 or not far_factor >= 1:
            raise ValueError(f"need min_voters >= 1 and far_factor >= 1, got {min_voters}, "
                             f"{far_factor}")
        self.multiplier = float(multiplier)
        self.min_voters = int(min_voters)
        self.far_factor = float(far_factor)
        self._initial = {
            k: v.detach().clone() for k, v in initial.items() if v.is_floating_point()
        }
        self._lock = threading.Lock()
        self._votes: dict[int, float] = {}

    @property
    def warming_up(self) -> bool:
        """Whether fewer than ``min_voters`` peers have voted yet."""
        with self._lock:
            return len(self._votes) < self.min_voters

    def drift(self, own: Mapping[str, torch.Tensor]) -> float:
        """``||own - initial||`` over the floating-point tensors."""
        return state_norm({k: own[k] - v for k, v in self._initial.items()})

    def bound(self, own: Mapping[str, torch.Tensor] | None = None) -> tuple[float, bool]:
        """The current ``tau`` and whether it is the warm-up bound.

        ``own`` (the node's model) is needed during the warm-up only; without it the
        warm-up bound is ``inf``.
        """
        with self._lock:
            votes = sorted(self._votes.values())
        if len(votes) >= self.min_voters:
            middle = len(votes) // 2
            median = votes[middle] if len(votes) % 2 else 0.5 * (votes[middle - 1] + votes[middle])
            return self.multiplier * median, False
        if own is None:
            return math.inf, True
        return self.multiplier * self.drift(own), True

    def clip(
        self,
        sender: int,
        update: Mapping[str, torch.Tensor],
        own: Mapping[str, torch.Tensor] | None = None,
        scale: float = 1.0,
    ) -> ClipOutcome:
        """Bound ``update = scale * d`` (``d`` the sender's difference) to ``scale * tau``.

        Parameters
        ----------
        sender : int
            The peer the difference comes from (its vote is replaced).
        update : Mapping[str, torch.Tensor]
            ``scale`` times the difference (floating-point tensors only).
        own : Mapping[str, torch.Tensor], optional
            The node's model, for the warm-up bound.
        scale : float
            Factor already applied to the difference (e.g. the consensus step), ``> 0``.

        Returns
        -------
        ClipOutcome
            The update to apply and what was done.
        """
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        norm = state_norm(update) / scale
        tau, warm = self.bound(own)
        if not math.isfinite(norm):
            # Admission refuses non-finite weights first; never apply such an update.
            return ClipOutcome({k: torch.zeros_like(v) for k, v in update.items()}, norm, tau,
                               "clip-far")
        reason: str | None = None
        applied = dict(update)
        if norm > tau:
            reason = "clip-warm-up" if warm else "clip"
            if tau > 0.0 and norm > self.far_factor * tau / self.multiplier:
                reason = "clip-far"
            factor = tau / norm
            applied = {k: v * factor for k, v in update.items()}
        if norm > 0.0:
            with self._lock:
                self._votes[sender] = norm
        return ClipOutcome(applied, norm, tau, reason)

    def votes(self) -> dict[int, float]:
        """``{peer: its recorded norm}``, a copy."""
        with self._lock:
            return dict(self._votes)
