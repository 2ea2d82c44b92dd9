"""The last rounds' grid updates, compactly, and catch-ups summed from them.

:class:`GridLog` keeps the updates of the last ``capacity`` rounds (ternary codes packed
2 bits a value, wider codes as int8, plus exponents and rebase flags). A replica at
``from_version`` reaches ``to_version`` bit for bit by applying the
:class:`~fedddl.compression.codecs.count_delta.CountDelta` of :meth:`GridLog.catch_up`:
one segment per stretch of rounds between rebases, each tensor's delta the exact sum of
the stretch's codes at its smallest exponent, ``sum_t c_t << (e_t - min e)``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from fedddl.compression.backends.packing import pack_codes
from fedddl.compression.backends.unpacking import unpack_codes
from fedddl.compression.codecs.count_delta import MAX_DELTA, CountDelta, CountSegment
from fedddl.sync.grid import shift_left

__all__ = ["MAX_CAPACITY", "GridLog"]

#: Most rounds a log keeps; with terms below ``2**40`` their int64 sums are exact.
MAX_CAPACITY = 2**20
_TERM_BITS = 40


@dataclass(frozen=True)
class _Codes:
    """One tensor's codes of one round: 2-bit packed when ternary, else int8."""

    unit: int
    shape: tuple[int, ...]
    data: torch.Tensor
    packed: bool

    @classmethod
    def of(cls, unit: int, codes: torch.Tensor) -> _Codes:
        flat = codes.detach().to(device="cpu", dtype=torch.int64).reshape(-1)
        peak = int(flat.abs().max()) if flat.numel() else 0
        if peak > 127:
            raise ValueError(f"grid log: codes up to {peak}, beyond int8")
        if peak <= 1:
            ternary = torch.remainder(flat, 3).to(torch.uint8)  # -1 -> 2 (the minus code)
            return cls(unit, tuple(codes.shape), pack_codes(ternary, "2bit"), True)
        return cls(unit, tuple(codes.shape), flat.to(torch.int8), False)

    def codes(self) -> torch.Tensor:
        """The codes as a 1-D int64 tensor."""
        numel = 1
        for size in self.shape:
            numel *= size
        if not self.packed:
            return self.data.to(torch.int64)
        return unpack_codes(self.data, numel, 1.0, "2bit").to(torch.int64)


@dataclass(frozen=True)
class _Round:
    version: int
    rebase: bool
    tensors: dict[str, _Codes]


class GridLog:
    """A bounded log of grid updates that answers catch-ups.

    Parameters
    ----------
    capacity:
        How many rounds' updates to keep (1 to :data:`MAX_CAPACITY`).
    version:
        The version before the first update appended.
    """

    def __init__(self, capacity: int, version: int = 0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise ValueError(f"capacity must be an int, got {capacity!r}")
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in [1, {MAX_CAPACITY}], got {capacity}")
        self.capacity = capacity
        self._rounds: deque[_Round] = deque(maxlen=capacity)
        self._newest = version

    @property
    def newest(self) -> int:
        """The version the newest update produces (the current version)."""
        return self._newest

    @property
    def oldest(self) -> int:
        """The oldest version a catch-up can start from."""
        return self._newest - len(self._rounds)

    @property
    def nbytes(self) -> int:
        """Bytes of codes held (2 bits a value for ternary rounds, 8 otherwise)."""
        return sum(c.data.numel() for r in self._rounds for c in r.tensors.values())

    def append(self, version: int, update: CountSegment) -> None:
        """Record the update that produces ``version`` (``newest + 1``)."""
        if version != self._newest + 1:
            raise ValueError(f"grid log: version {version} follows {self._newest}")
        tensors = {
            name: _Codes.of(update.units[name], codes) for name, codes in update.deltas.items()
        }
        if self._rounds and list(tensors) != list(self._rounds[-1].tensors):
            raise ValueError(f"grid log: tensors {list(tensors)} differ from the last round's")
        self._rounds.append(_Round(version, update.rebase, tensors))
        self._newest = version

    def catch_up(self, from_version: int, to_version: int | None = None) -> CountDelta | None:
        """The count delta from ``from_version`` to ``to_version`` (default: the newest).

        Returns
        -------
        CountDelta or None
            ``None`` when the log cannot give one (``from_version`` older than the log, or,
            rarely, a delta beyond ``MAX_DELTA``): send a snapshot instead.

        Raises
        ------
        ValueError
            ``from_version > to_version`` or ``to_version`` newer than the log.
        """
        to = self._newest if to_version is None else to_version
        if from_version > to or to > self._newest:
            raise ValueError(
                f"grid log: no catch-up from {from_version} to {to} (newest {self._newest})"
            )
        if from_version < self.oldest:
            return None
        rounds = [r for r in self._rounds if from_version < r.version <= to]
        stretches: list[list[_Round]] = []
        for r in rounds:
            if r.rebase or not stretches:
                stretches.append([])
            stretches[-1].append(r)
        segments: list[CountSegment] = []
        for stretch in stretches:
            segment = _summed(stretch)
            if segment is None:
                return None
            segments.append(segment)
        return CountDelta(from_version, to, tuple(segments))


def _summed(stretch: list[_Round]) -> CountSegment | None:
    """One segment equal to the stretch's rounds applied in turn, or ``None`` on overflow."""
    units: dict[str, int] = {}
    deltas: dict[str, torch.Tensor] = {}
    for name, first in stretch[0].tensors.items():
        unit = min(r.tensors[name].unit for r in stretch)
        total: torch.Tensor | None = None
        for r in stretch:
            entry = r.tensors[name]
            term = shift_left(entry.codes(), entry.unit - unit, limit=_TERM_BITS)
            if term is None:
                return None
            total = term if total is None else total + term
        assert total is not None
        if total.numel() and int(total.abs().max()) > MAX_DELTA:
            return None
        units[name] = unit
        deltas[name] = total.to(torch.int32).reshape(first.shape)
    return CountSegment(rebase=stretch[0].rebase, units=units, deltas=deltas)
