"""Integer count deltas on a power-of-two grid: the data a grid catch-up carries.

A replica on the grid holds, per named tensor, an fp32 anchor, integer counts and a unit
exponent; its value is ``anchor + counts * 2**unit``. A :class:`CountSegment` moves
every tensor by an integer delta at a unit exponent, after an optional rebase; a round's
update is one segment whose deltas are the round's codes, and a catch-up over many rounds
is a :class:`CountDelta`, one segment per rebase. The wire format is
:mod:`fedddl.compression.codecs.counts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "MAX_COUNT",
    "MAX_DELTA",
    "MAX_EXPONENT",
    "MIN_EXPONENT",
    "CountDelta",
    "CountSegment",
    "Layout",
]

#: Largest ``|counts|`` a replica may hold: every count is exact in float32.
MAX_COUNT = 2**24
#: Largest ``|delta|`` one segment may carry (a difference of two bounded counts).
MAX_DELTA = 2 * MAX_COUNT
#: Unit exponents allowed: ``counts * 2**unit`` is a normal, finite float32.
MIN_EXPONENT = -126
MAX_EXPONENT = 103

#: Tensor names and shapes, in order.
Layout = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class CountSegment:
    """Per tensor, an integer delta at a unit exponent, after an optional rebase.

    Attributes
    ----------
    rebase:
        Whether every tensor first rebases (``anchor = value``, ``counts = 0``, no unit).
    units:
        Name -> the exponent of one step of ``deltas[name]``.
    deltas:
        Name -> an integer tensor of the tensor's shape.
    """

    rebase: bool
    units: Mapping[str, int]
    deltas: Mapping[str, torch.Tensor]

    def layout(self) -> dict[str, tuple[int, ...]]:
        """The names and shapes of the deltas."""
        return {name: tuple(delta.shape) for name, delta in self.deltas.items()}


@dataclass(frozen=True)
class CountDelta:
    """The segments that take a replica from ``from_version`` to ``to_version``."""

    from_version: int
    to_version: int
    segments: tuple[CountSegment, ...] = field(default=())
