"""A model on the integer grid that follows a sequence of target models.

:class:`GridFollower` holds ``value = anchor + counts * 2**unit`` per tensor
(:class:`~fedddl.sync.grid.GridState`) with **zero anchors**, so version 0 is the all-zero
state that every holder has without a message. The first target goes onto the grid at
:data:`INITIAL_BITS` bits a tensor (rounded to nearest); each later target ``t`` moves it by
one :class:`~fedddl.sync.grid_quantizer.GridQuantizer` step: the step ``t - previous target``
with the residual ``previous target - value``, so what is quantized is the whole gap
``t - value`` and nothing is lost over rounds; the exponent follows the step (optionally
clipped), at least :data:`PRECISION_BITS` below the tensor's peak (the counts stay bounded),
and codes round to the nearest by default: stochastic rounding would add noise that clients
training from the broadcast feed back into the target. Each update goes into a
:class:`~fedddl.sync.grid_log.GridLog`.

:meth:`GridFollower.catch_up` gives a holder at version ``v`` one count-delta message
(:mod:`fedddl.compression.codecs.counts`): the log's summed counts since ``v``, or the counts
from version 0 (``v`` unknown, beyond the log, or that message is smaller). Only after a
rebase (counts that would overflow) are the anchors non-zero; a message from version 0 then
needs them too (:meth:`GridFollower.anchors`). Holders apply messages with
:func:`fedddl.sync.grid_holder.reach`; every holder's state equals the follower's bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch

from fedddl.compression.codecs.count_delta import (
    MAX_EXPONENT,
    MIN_EXPONENT,
    CountDelta,
    CountSegment,
)
from fedddl.compression.codecs.counts import encode_counts
from fedddl.sync.grid import GridState
from fedddl.sync.grid_log import GridLog
from fedddl.sync.grid_quantizer import GridQuantizer, fitting_exponent

__all__ = ["INITIAL_BITS", "PRECISION_BITS", "GridFollower"]

#: Bits a tensor of the first target gets (its peak is ``2**(INITIAL_BITS - 1)`` units).
INITIAL_BITS = 8
#: A step's exponent is at least this many bits below its tensor's peak.
PRECISION_BITS = 20


def _floor(peak: float, bits: int) -> int | None:
    """The exponent ``e`` with ``peak <= 2**bits * 2**e`` (None for a zero peak)."""
    if not peak > 0:
        return None
    return min(max(fitting_exponent(peak, 1 << bits), MIN_EXPONENT), MAX_EXPONENT)


def _peak(tensor: torch.Tensor) -> float:
    return float(tensor.abs().max()) if tensor.numel() else 0.0


class GridFollower:
    """The grid model, its quantizer and log (see the module docstring).

    Parameters
    ----------
    levels : int
        A step's codes lie in ``[-levels, levels]`` (1 to 127).
    log_size : int
        Updates kept for catch-ups.
    seed : int
        Seeds the quantizer's stochastic rounding.
    start : int
        The version before the first target (versions up to it are another model's).
    stochastic, clip_sigma : bool, float or None
        The quantizer's rounding and clipping (:class:`~fedddl.sync.grid_quantizer.GridQuantizer`).
    """

    def __init__(
        self,
        levels: int = 1,
        log_size: int = 64,
        seed: int = 0,
        start: int = 0,
        *,
        stochastic: bool = False,
        clip_sigma: float | None = None,
    ) -> None:
        if start < 0:
            raise ValueError(f"grid follower: start must be >= 0, got {start}")
        self.quantizer = GridQuantizer(
            levels, seed, clip_sigma, error_feedback=True, stochastic=stochastic
        )
        self.log = GridLog(log_size, version=start + 1)
        self.state: GridState | None = None
        self.start = start
        self.version = start
        #: Whether a rebase made the anchors non-zero.
        self.rebased = False
        self._target: dict[str, torch.Tensor] = {}
        self._messages: dict[int, tuple[int, bytes]] = {}

    @property
    def layout(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes (empty before the first target)."""
        return {} if self.state is None else self.state.layout

    def values(self) -> dict[str, torch.Tensor]:
        """Name -> the float32 value at the current version (new tensors)."""
        return {} if self.state is None else self.state.values()

    def anchors(self) -> dict[str, torch.Tensor]:
        """Name -> the float32 anchor (zeros unless :attr:`rebased`)."""
        return {} if self.state is None else self.state.anchors()

    def follow(self, target: Mapping[str, torch.Tensor]) -> None:
        """Move onto the grid towards ``target`` (the next version), all or nothing.

        Raises
        ------
        ValueError
            A target that is not finite, beyond the grid's range, or (after the first) of
            another layout; nothing is changed.
        """
        wanted = {n: t.detach().to(device="cpu", dtype=torch.float32) for n, t in target.items()}
        for name, tensor in wanted.items():
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"grid follower: {name!r} is not finite")
        if self.state is None:
            state, segment = self._first(wanted)
        else:
            state, segment = self._step(self.state, wanted)
        self.version += 1
        if self.version > self.start + 1:
            self.log.append(self.version, segment)
        self.rebased = self.rebased or segment.rebase
        self.state = state
        self._target = {n: t.clone() for n, t in wanted.items()}
        self._messages.clear()

    def _first(self, wanted: dict[str, torch.Tensor]) -> tuple[GridState, CountSegment]:
        units: dict[str, int] = {}
        deltas: dict[str, torch.Tensor] = {}
        for name, tensor in wanted.items():
            e = _floor(_peak(tensor), INITIAL_BITS - 1)
            unit = MAX_EXPONENT if e is None else e
            if unit >= MAX_EXPONENT and e is not None:
                raise ValueError(f"grid follower: {name!r} is too large for the grid")
            scaled = tensor.to(torch.float64) * math.ldexp(1.0, -unit)
            units[name] = unit
            deltas[name] = torch.round(scaled).to(torch.int32)
        segment = CountSegment(rebase=False, units=units, deltas=deltas)
        state = GridState({n: torch.zeros_like(t) for n, t in wanted.items()})
        state.apply(segment)
        return state, segment

    def _step(
        self, state: GridState, wanted: dict[str, torch.Tensor]
    ) -> tuple[GridState, CountSegment]:
        if {n: tuple(t.shape) for n, t in wanted.items()} != state.layout:
            raise ValueError("grid follower: the target's tensors are not the grid's")
        quantizer = self.quantizer
        values = state.values()
        steps = {n: wanted[n] - self._target[n] for n in wanted}
        floors = {
            n: e for n, e in ((n, _floor(_peak(t), PRECISION_BITS)) for n, t in wanted.items())
            if e is not None
        }  # fmt: skip
        saved = (dict(quantizer.residuals), dict(quantizer.exponents))
        quantizer.residuals = {n: self._target[n] - values[n] for n in wanted}
        try:
            segment = quantizer.quantize(self.version + 1, steps, floors)
            grid = state.copy()
            if grid.needs_rebase(segment):
                segment = replace(segment, rebase=True)
            grid.apply(segment)
        except Exception:
            quantizer.residuals, quantizer.exponents = saved
            raise
        return grid, segment

    def catch_up(self, known: int) -> tuple[int, bytes]:
        """``(base, message)`` that brings a holder at ``known`` (-1: none) to the current
        version: ``base = known`` for the log's counts since ``known``, 0 for the counts from
        version 0 (with the :meth:`anchors` when :attr:`rebased`: then ``base = -1``). A
        holder at :attr:`start` or before holds no state of this model.

        Raises
        ------
        ValueError
            Before the first target, or ``known`` newer than the current version.
        """
        if self.state is None:
            raise ValueError("grid follower: no target yet")
        if known > self.version:
            raise ValueError(f"grid follower: version {known} is newer than {self.version}")
        found = self._messages.get(known)
        if found is not None:
            return found
        snapshot = self._from_zero()
        answer = snapshot
        if known > self.start:
            delta = self.log.catch_up(known) if known >= self.log.oldest else None
            if known == self.version:
                delta = CountDelta(known, known, ())
            if delta is not None:
                message = encode_counts(delta, self.layout)
                if len(message) < len(snapshot[1]) + self._anchor_bytes():
                    answer = (known, message)
        self._messages[known] = answer
        return answer

    def _anchor_bytes(self) -> int:
        """Bytes of the anchors a message from version 0 carries (0 unless rebased)."""
        if not self.rebased:
            return 0
        return 4 * sum(math.prod(shape) for shape in self.layout.values())

    def _from_zero(self) -> tuple[int, bytes]:
        found = self._messages.get(0)
        if found is None:
            assert self.state is not None
            delta = CountDelta(0, self.version, (self.state.snapshot_segment(),))
            found = (-1 if self.rebased else 0, encode_counts(delta, self.layout))
            self._messages[0] = found
        return found
