"""The settings of a :class:`~fedddl.sync.server.ReplicaServer`'s defences against bad replies.

This module imports nothing heavy (no torch): :mod:`fedddl.app_config` validates with it.

Always on, with no setting: every exception raised while handling one reply drops that
reply with a logged reason; each payload's header is checked against the model before
anything is decoded (:mod:`fedddl.sync.screening`); a round whose aggregate cannot be
combined, encoded or applied is skipped and logged; sums cannot overflow
(:mod:`fedddl.sync.aggregation`). Configurable here (run-config keys in brackets):

* ``aggregator`` (``aggregator``): how accepted gradients are combined
  (:mod:`fedddl.sync.robust`), with ``trim_fraction`` (``trim-fraction``) for the trimmed
  mean;
* the header scale bound (:mod:`fedddl.sync.scale_bound`): ``scale_bound`` (``scale-bound``,
  the factor ``k``; 0 disables it), ``scale_bound_action`` (``scale-bound-action``) and
  ``scale_bound_rounds`` (``scale-bound-rounds``); the same factor caps the shared scales
  of the ``shared-scale-sum`` downlink at ``k ×`` the median of the reported ones;
  ``scale_weight`` (``scale-weight``): a scale above that multiple of the median is
  clipped to it (0: clipped only above the bound);
* ``statistics_bound`` (``statistics-bound``): a reply's BatchNorm statistics are clipped to
  within that many standard deviations of the shadow replica's running statistics (means;
  variances to within that factor squared; :mod:`fedddl.sync.statistics_shadow`; 0: off);
* ``direction_check`` (``direction-check``): a reply whose signs agree with the other
  replies' majority vote less than this fraction of the round's median agreement is
  dropped, and so is a reply with more than twice the round's median count of non-zero
  values (:mod:`fedddl.sync.direction`; 0: both off);
* ``norm_clip`` (``norm-clip``): per tensor, a reply whose norm is above that multiple of
  the lower median of the round's norms (after the direction check) is scaled down to it
  (:mod:`fedddl.sync.norm_clip`; 0: off; not with the ``shared-scale-sum`` downlink,
  whose values are all at the server's shared scales);
* ``resync_interval`` (``resync-interval``): resyncs a node causes are served at most once
  every that many rounds (:mod:`fedddl.sync.resync_limit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AGGREGATORS", "SCALE_BOUND_ACTIONS", "Defenses"]

#: Names of the aggregators of :mod:`fedddl.sync.robust`.
AGGREGATORS: tuple[str, ...] = ("mean", "median", "trimmed-mean", "sign-vote")
#: What the scale bound of :mod:`fedddl.sync.scale_bound` does to a reply above it.
SCALE_BOUND_ACTIONS: tuple[str, ...] = ("clip", "drop")


@dataclass(frozen=True)
class Defenses:
    """Defence settings (see the module docstring); the defaults are the run's defaults."""

    aggregator: str = "mean"
    trim_fraction: float = 0.2
    scale_bound: float = 8.0
    scale_bound_action: str = "clip"
    scale_bound_rounds: int = 10
    scale_weight: float = 3.0
    resync_interval: int = 30
    direction_check: float = 0.1
    statistics_bound: float = 4.0
    norm_clip: float = 1.5

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the bad setting."""
        if self.aggregator not in AGGREGATORS:
            raise ValueError(
                f"aggregator must be one of {', '.join(AGGREGATORS)}, got {self.aggregator!r}"
            )
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim-fraction must be in [0, 0.5), got {self.trim_fraction}")
        if not (self.scale_bound == 0 or 1 <= self.scale_bound < math.inf):
            raise ValueError(f"scale-bound must be 0 (off) or >= 1, got {self.scale_bound}")
        if self.scale_bound_action not in SCALE_BOUND_ACTIONS:
            raise ValueError(
                f"scale-bound-action must be one of {', '.join(SCALE_BOUND_ACTIONS)}, "
                f"got {self.scale_bound_action!r}"
            )
        if self.scale_bound_rounds < 0:
            raise ValueError(f"scale-bound-rounds must be >= 0, got {self.scale_bound_rounds}")
        if not (self.scale_weight == 0 or 1 <= self.scale_weight < math.inf):
            raise ValueError(f"scale-weight must be 0 (off) or >= 1, got {self.scale_weight}")
        if not 0 <= self.direction_check <= 1:
            raise ValueError(f"direction-check must be in [0, 1], got {self.direction_check}")
        if not (self.statistics_bound == 0 or 1 <= self.statistics_bound < math.inf):
            raise ValueError(
                f"statistics-bound must be 0 (off) or >= 1, got {self.statistics_bound}"
            )
        if not (self.norm_clip == 0 or 1 <= self.norm_clip < math.inf):
            raise ValueError(f"norm-clip must be 0 (off) or >= 1, got {self.norm_clip}")
        if self.resync_interval < 0:
            raise ValueError(f"resync-interval must be >= 0, got {self.resync_interval}")
