"""A per-tensor bound on the ternary scales of a round's replies, from the honest majority.

A ternary entry decodes to ``scale × code`` with ``code`` in {-1, 0, +1}, so its scale
bounds every value it can contribute. Honest clients of one round report similar scales
(``docs/untrusted-clients.md``); one client reporting ``1e6`` or ``1e30`` is not honest and
would dominate a mean.

:class:`ScaleBound` reads the scales from the payload *headers*
(:func:`fedddl.compression.codecs.wire.read_header`), before anything is decoded. Per tensor:

* ``reference`` = the lower median of the scales of this round's screened replies together
  with the accepted scales of the previous ``rounds`` rounds (so a round whose replies are
  mostly an attacker's cannot move it far, and one attacker can never move it: it is a
  median);
* ``bound`` = ``factor × reference``; with the ``shared-scale-sum`` downlink the bound of a
  tensor is the shared scale the server sent for it (every honest client encodes at
  exactly that scale);
* ``cap`` = ``weight × reference`` (at most the bound): a reply's scale above it is
  **clipped** to it (its decoded values become ``± cap``, its codes are kept), so one
  client weighs at most ``weight`` honest clients of median scale, not ``factor`` of them;
* a reply with a scale above the bound is clipped to the cap as well (action ``"clip"``)
  or **dropped** (action ``"drop"``); the reason names the tensor, the scale and the limit.

Only the scales at or below their bound enter the history. ``factor = 0`` disables the
bound (and the cap); ``weight = 0`` disables the cap (clipping then goes to the bound).
A dense entry (TernGrad's fp32-exempt tensors, a compressor's small tensors sent
uncompressed) is bounded the same way by its largest magnitude
(:attr:`~fedddl.compression.codecs.wire.EntryHeader.peak`, measured from the header's dense data
before anything else is decoded); clipping it clamps its values to ``± cap``. A ternary entry
with scale buckets (``scale-bucket``) is bounded by its header scale, the largest of its bucket
scales (the tensor's scale without buckets, the largest clipped ``|g|``, to within one
float32 rounding),
and clipping clamps its values to ``± cap``: each bucket's scale becomes at most the cap, the
codes are kept, and buckets already under the cap keep their scale.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedddl.compression import EntryHeader
from fedddl.defenses import SCALE_BOUND_ACTIONS, Defenses

__all__ = [
    "DEFAULT_WEIGHT",
    "MAX_HISTORY_SCALE",
    "SCALE_BOUND_ACTIONS",
    "BoundVerdict",
    "ScaleBound",
    "lower_median",
    "magnitude",
]

#: The largest scale a restored history may hold: far above any honest gradient's
#: ``max|g|``, far below what would switch the bound off (``factor ×`` it overflowing).
MAX_HISTORY_SCALE = 1e6
#: The default cap on a reply's scale, as a multiple of the round's median scale.
DEFAULT_WEIGHT = Defenses().scale_weight


def magnitude(entry: EntryHeader) -> float | None:
    """The largest magnitude an entry can contribute: its scale when ternary, its measured
    peak when dense (None: not measured)."""
    return entry.scale if entry.codec is not None else entry.peak


def lower_median(values: Sequence[float]) -> float:
    """The lower median (``sorted(values)[(n - 1) // 2]``): always one of ``values``.

    Raises
    ------
    ValueError
        If ``values`` is empty.
    """
    if not values:
        raise ValueError("the median of no values is undefined")
    return sorted(values)[(len(values) - 1) // 2]


@dataclass
class BoundVerdict:
    """What the bound decided for one round's replies.

    Attributes
    ----------
    clip : dict[int, dict[str, float]]
        Node → tensor → limit: decode the tensor as ``limit × code``.
    clipped : dict[int, str]
        Node → why it was clipped.
    dropped : dict[int, str]
        Node → why it was dropped (action ``"drop"``).
    bounds : dict[str, float]
        The bound of every tensor that had ternary entries.
    caps : dict[str, float]
        The cap of every tensor that had ternary entries (at most its bound).
    """

    clip: dict[int, dict[str, float]] = field(default_factory=dict)
    clipped: dict[int, str] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    caps: dict[str, float] = field(default_factory=dict)


class ScaleBound:
    """Bound each tensor's ternary scale by ``factor`` × a median (see the module docstring).

    Parameters
    ----------
    factor : float
        ``k`` of ``k × median``; 0 disables the bound.
    action : str
        ``"clip"`` or ``"drop"``.
    rounds : int
        Previous rounds whose accepted scales join the median (0: this round only).
    weight : float
        The cap's multiple of the median (0: no cap below the bound).
    """

    def __init__(
        self,
        factor: float = 8.0,
        action: str = "clip",
        rounds: int = 10,
        weight: float = DEFAULT_WEIGHT,
    ) -> None:
        if not (factor == 0 or 1 <= factor < math.inf):
            raise ValueError(f"scale-bound must be 0 (off) or >= 1, got {factor}")
        if not (weight == 0 or 1 <= weight < math.inf):
            raise ValueError(f"scale-weight must be 0 (off) or >= 1, got {weight}")
        if action not in SCALE_BOUND_ACTIONS:
            raise ValueError(
                f"scale-bound-action must be one of {', '.join(SCALE_BOUND_ACTIONS)}, "
                f"got {action!r}"
            )
        if rounds < 0:
            raise ValueError(f"scale-bound-rounds must be >= 0, got {rounds}")
        self.factor = float(factor)
        self.action = action
        self.rounds = rounds
        self.weight = float(weight)
        self.history: deque[dict[str, list[float]]] = deque(maxlen=max(rounds, 1))

    @property
    def enabled(self) -> bool:
        """Whether the bound is on."""
        return self.factor > 0

    def screen(
        self,
        headers: Mapping[int, Sequence[EntryHeader]],
        expected: Mapping[str, float] | None = None,
        floors: Mapping[str, float] | None = None,
    ) -> BoundVerdict:
        """Decide, from the headers of this round's screened replies, what to clip or drop.

        Parameters
        ----------
        headers : Mapping[int, Sequence[EntryHeader]]
            Node → the entries of its payload.
        expected : Mapping[str, float] | None
            Scales the server told every client to use this round (``shared-scale-sum``):
            they are the bounds of their tensors.
        floors : Mapping[str, float] | None
            Smallest bound of each named tensor (a scale this small is harmless whatever
            the median; keeps float noise of a tensor that does not learn from being
            judged against noise).

        Returns
        -------
        BoundVerdict
            Empty when the bound is off.
        """
        verdict = BoundVerdict()
        if not self.enabled:
            return verdict
        scales: dict[str, list[float]] = {}
        for entries in headers.values():
            for entry in entries:
                peak = magnitude(entry)
                if peak is not None:
                    scales.setdefault(entry.name, []).append(peak)
        for name, values in scales.items():
            told = None if expected is None else expected.get(name)
            if told is not None and told > 0:
                verdict.bounds[name] = verdict.caps[name] = told
                continue
            pooled = list(values)
            for past in self.history if self.rounds else ():
                pooled.extend(past.get(name, ()))
            reference = lower_median(pooled)
            floor = 0.0 if floors is None else floors.get(name, 0.0)
            verdict.bounds[name] = max(self.factor * reference, floor)
            cap = self.weight * reference if self.weight else verdict.bounds[name]
            verdict.caps[name] = min(max(cap, floor), verdict.bounds[name])
        accepted: dict[str, list[float]] = {}
        for node, entries in headers.items():
            peaks = [(e.name, magnitude(e)) for e in entries]
            over = [(n, p) for n, p in peaks if p is not None and p > verdict.bounds[n]]
            if over and self.action == "drop":
                self._judge(verdict, node, over)
                continue
            heavy = [(n, p) for n, p in peaks if p is not None and p > verdict.caps[n]]
            if heavy:
                self._judge(verdict, node, heavy)
            for name, peak in peaks:
                if peak is not None and peak <= verdict.bounds[name]:
                    accepted.setdefault(name, []).append(peak)
        if self.rounds:
            self.history.append(accepted)
        return verdict

    def _judge(self, verdict: BoundVerdict, node: int, over: list[tuple[str, float]]) -> None:
        """Clip ``over`` to the caps, or drop the node (action ``"drop"``, scales over the
        bound)."""
        dropping = self.action == "drop" and any(p > verdict.bounds[n] for n, p in over)
        name, scale = max(over, key=lambda item: item[1] / max(verdict.caps[item[0]], 1e-45))
        more = f" (and {len(over) - 1} more tensors)" if len(over) > 1 else ""
        bound, cap = verdict.bounds[name], verdict.caps[name]
        if dropping:
            outcome = "dropped"
        elif scale > bound:
            outcome = f"clipped to the cap {cap:.4g}"
        else:
            outcome = "clipped"
        limit = f"the bound {bound:.4g}" if scale > bound else f"the cap {cap:.4g}"
        reason = f"node {node}: scale {scale:.4g} of tensor {name!r} exceeds {limit}{more}: "
        reason += outcome
        if dropping:
            verdict.dropped[node] = reason
        else:
            verdict.clip[node] = {n: verdict.caps[n] for n, _ in over}
            verdict.clipped[node] = reason

    # ----------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """The history, as plain types (for a checkpoint)."""
        return {"history": [dict(entry) for entry in self.history]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`.

        Raises
        ------
        ValueError
            If ``state`` is malformed, or a scale is not finite or outside
            ``[0, MAX_HISTORY_SCALE]`` (nothing is changed then).
        """
        history = state.get("history", [])
        if not isinstance(history, list):
            raise ValueError("scale-bound history must be a list")
        rounds: list[dict[str, list[float]]] = []
        for entry in history:
            if not isinstance(entry, dict):
                raise ValueError("scale-bound history entries must be dicts")
            clean: dict[str, list[float]] = {}
            for name, values in entry.items():
                if not isinstance(name, str) or not isinstance(values, list):
                    raise ValueError("scale-bound history must map names to lists")
                try:
                    floats = [float(v) for v in values]
                except (TypeError, ValueError):
                    raise ValueError(f"scale-bound history of {name!r} has a bad scale") from None
                if not all(0 <= v <= MAX_HISTORY_SCALE for v in floats):
                    raise ValueError(
                        f"scale-bound history of {name!r} has a bad scale: not finite, or "
                        f"outside [0, {MAX_HISTORY_SCALE:g}]"
                    )
                clean[name] = floats
            rounds.append(clean)
        self.history.clear()
        self.history.extend(rounds[-(self.history.maxlen or 1) :])
