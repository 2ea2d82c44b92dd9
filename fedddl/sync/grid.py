"""Replica state on an integer grid: per tensor ``value = anchor + counts * 2**unit``.

Every replica (the server's and each client's) holds, per named tensor, an fp32
``anchor``, int32 ``counts`` and an int ``unit`` exponent (``None`` before the first update
after a rebase). Updates are :class:`~fedddl.compression.codecs.count_delta.CountSegment`:

1. if the segment rebases: ``anchor = value``, ``counts = 0``, ``unit = None``;
2. per tensor, at exponent ``e`` with integer delta ``d``: the unit only refines
   (``unit' = min(unit, e)``, the counts shift left by ``unit - unit'``), then
   ``counts += d << (e - unit')``.

All of this is exact integer arithmetic, so applying a round at a time and applying a
summed catch-up (:class:`fedddl.sync.grid_log.GridLog`) give the same counts, and
:meth:`GridState.values` (one IEEE float32 addition of an exact product) gives the same
bits everywhere. An update that would take ``|counts|`` past
:data:`~fedddl.compression.codecs.count_delta.MAX_COUNT` is refused whole; the server
flags a rebase in such a round (:meth:`GridState.needs_rebase`), so no replica ever refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedddl.compression.codecs.count_delta import (
    MAX_COUNT,
    MAX_DELTA,
    MAX_EXPONENT,
    MIN_EXPONENT,
    CountDelta,
    CountSegment,
)
from fedddl.replica import ReplicaError

__all__ = ["GridError", "GridState", "GridTensor", "grid_value", "shift_left"]

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


class GridError(ReplicaError):
    """A grid update does not fit a replica (names, shapes, exponents, or count overflow)."""


def shift_left(values: torch.Tensor, bits: int, limit: int = 62) -> torch.Tensor | None:
    """``values << bits`` as int64, or ``None`` if some result would reach ``2**limit``
    (``limit <= 62``)."""
    wide = values.to(torch.int64)
    if bits == 0:
        return wide
    peak = int(wide.abs().max()) if wide.numel() else 0
    if peak == 0:
        return wide
    if bits >= limit or peak >= 1 << (limit - bits):
        return None
    return torch.bitwise_left_shift(wide, bits)


def grid_value(anchor: torch.Tensor, counts: torch.Tensor, unit: int | None) -> torch.Tensor:
    """``anchor + counts * 2**unit`` in float32: an exact product, one rounding in the add."""
    if unit is None:
        return anchor.clone()
    return torch.add(anchor, counts.to(torch.float32) * (2.0**unit))


@dataclass
class GridTensor:
    """One tensor on the grid: ``anchor`` (float32), ``counts`` (int32), ``unit``."""

    anchor: torch.Tensor
    counts: torch.Tensor
    unit: int | None = None

    def value(self) -> torch.Tensor:
        """The tensor's float32 value (a new tensor)."""
        return grid_value(self.anchor, self.counts, self.unit)


def _check_segment(segment: CountSegment, layout: Mapping[str, tuple[int, ...]]) -> None:
    if list(segment.deltas) != list(layout) or list(segment.units) != list(layout):
        raise GridError(
            f"grid update: tensors {list(segment.deltas)} (units {list(segment.units)}), "
            f"expected {list(layout)}"
        )
    for name, shape in layout.items():
        delta, unit = segment.deltas[name], segment.units[name]
        if tuple(delta.shape) != shape:
            raise GridError(
                f"grid update: {name!r} has shape {tuple(delta.shape)}, expected {shape}"
            )
        if delta.dtype not in _INTEGER_DTYPES:
            raise GridError(f"grid update: {name!r} has dtype {delta.dtype}, expected an integer")
        if isinstance(unit, bool) or not isinstance(unit, int):
            raise GridError(f"grid update: {name!r} has unit {unit!r}, expected an int")
        if not MIN_EXPONENT <= unit <= MAX_EXPONENT:
            raise GridError(
                f"grid update: {name!r} has unit {unit}, outside [{MIN_EXPONENT}, {MAX_EXPONENT}]"
            )
        if delta.numel() and int(delta.to(torch.int64).abs().max()) > MAX_DELTA:
            raise GridError(f"grid update: {name!r} has a delta beyond {MAX_DELTA}")


class GridState:
    """Named tensors on the grid; see the module docstring for the update rule.

    Parameters
    ----------
    tensors:
        Name -> initial value (copied as float32 anchors; counts 0, no unit), in order.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors: dict[str, GridTensor] = {
            name: GridTensor(
                anchor=t.detach().to(device="cpu", dtype=torch.float32).clone(),
                counts=torch.zeros(tuple(t.shape), dtype=torch.int32),
            )
            for name, t in tensors.items()
        }

    @property
    def layout(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes, in order."""
        return {name: tuple(t.anchor.shape) for name, t in self.tensors.items()}

    def values(self) -> dict[str, torch.Tensor]:
        """Name -> float32 value (new tensors)."""
        return {name: t.value() for name, t in self.tensors.items()}

    def units(self) -> dict[str, int | None]:
        """Name -> the current unit exponent."""
        return {name: t.unit for name, t in self.tensors.items()}

    def copy(self) -> GridState:
        """An independent copy."""
        other = GridState({})
        other.tensors = {
            name: GridTensor(t.anchor.clone(), t.counts.clone(), t.unit)
            for name, t in self.tensors.items()
        }
        return other

    def anchors(self) -> dict[str, torch.Tensor]:
        """Name -> the float32 anchor (new tensors)."""
        return {name: t.anchor.clone() for name, t in self.tensors.items()}

    def snapshot_segment(self) -> CountSegment:
        """The counts as one segment from zero, for :meth:`from_snapshot` (a tensor with no
        unit carries zeros at ``MAX_EXPONENT``)."""
        units = {n: MAX_EXPONENT if t.unit is None else t.unit for n, t in self.tensors.items()}
        counts = {name: t.counts.clone() for name, t in self.tensors.items()}
        return CountSegment(rebase=False, units=units, deltas=counts)

    @classmethod
    def from_snapshot(cls, anchors: Mapping[str, torch.Tensor], segment: CountSegment) -> GridState:
        """The state whose :meth:`anchors` and :meth:`snapshot_segment` these are.

        Raises
        ------
        GridError
            As :meth:`apply`.
        """
        state = cls(anchors)
        state.apply(segment)
        for t in state.tensors.values():
            if t.unit == MAX_EXPONENT and not bool(t.counts.any()):
                t.unit = None  # the same state: zero counts at any unit behave alike
        return state

    def rebase(self) -> None:
        """``anchor = value``, ``counts = 0``, no unit, for every tensor."""
        for t in self.tensors.values():
            t.anchor = t.value()
            t.counts = torch.zeros_like(t.counts)
            t.unit = None

    def _planned(self, segment: CountSegment) -> dict[str, tuple[torch.Tensor, int]] | str:
        """The new (counts, unit) per tensor, or the reason the segment overflows."""
        _check_segment(segment, self.layout)
        planned: dict[str, tuple[torch.Tensor, int]] = {}
        for name, t in self.tensors.items():
            unit, delta = segment.units[name], segment.deltas[name]
            counts, old = (t.counts, t.unit) if not segment.rebase else (None, None)
            new = unit if old is None else min(old, unit)
            base = shift_left(counts, old - new) if counts is not None and old is not None else 0
            step = shift_left(delta, unit - new)
            if base is None or step is None:
                return f"{name!r}: a shift to unit {new} overflows"
            total = step + base
            if total.numel() and int(total.abs().max()) > MAX_COUNT:
                return f"{name!r}: |counts| would exceed {MAX_COUNT}"
            planned[name] = (total.to(torch.int32), new)
        return planned

    def needs_rebase(self, segment: CountSegment) -> bool:
        """Whether applying ``segment`` (without a rebase) would overflow the counts."""
        if segment.rebase:
            return False
        return isinstance(self._planned(segment), str)

    def apply(self, segment: CountSegment) -> None:
        """Apply one segment (a round's update or a catch-up segment), all or nothing.

        Raises
        ------
        GridError
            Names, shapes, dtypes or units that do not fit, a delta beyond ``MAX_DELTA``,
            or counts that would exceed ``MAX_COUNT`` (nothing is changed).
        """
        planned = self._planned(segment)
        if isinstance(planned, str):
            raise GridError(f"grid update overflows: {planned}")
        if segment.rebase:
            self.rebase()
        for name, (counts, unit) in planned.items():
            self.tensors[name].counts, self.tensors[name].unit = counts, unit

    def apply_catch_up(self, delta: CountDelta) -> None:
        """Apply every segment of a catch-up in turn, all or nothing.

        Raises
        ------
        GridError
            As :meth:`apply`, for any segment (the state is then unchanged).
        """
        trial = self.copy()
        for segment in delta.segments:
            trial.apply(segment)
        self.tensors = trial.tensors
