"""The ``grid`` downlink of ``TernaryDelta`` in Flower messages: its two records, once.

A message of the ``grid`` downlink carries, besides :data:`~fedddl.flower.delta_protocol.META`
(whose ``base`` is the version the counts start from: ``>= 1`` the node's model, ``0`` the
all-zero model, ``-1`` the :data:`ANCHORS_KEY` anchors with zero counts), the :data:`GRID`
ArrayRecord (:data:`COUNTS_KEY`: a count-delta message,
:mod:`fedddl.compression.codecs.counts`; :data:`ANCHORS_KEY`: the float32 anchors of every
tensor, concatenated, when ``base`` is -1) and the :data:`GRID_LAYOUT` ConfigRecord (the grid
tensors' names, shapes and dtypes, in order). The model record holds the other Arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, RecordDict

__all__ = ["ANCHORS_KEY", "COUNTS_KEY", "GRID", "GRID_LAYOUT", "GridLayout", "parse_grid_layout"]

GRID = "fedddl.ternary.grid"
GRID_LAYOUT = "fedddl.ternary.grid-layout"
COUNTS_KEY = "counts"
ANCHORS_KEY = "anchors"
_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class GridLayout:
    """The grid tensors: name -> shape, and name -> dtype (what the model's array holds);
    with a whole model, ``units``: each tensor's unit exponent, from which a client rebuilds
    the grid state (zero anchors: counts = value / 2**unit)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    units: dict[str, int] | None = None

    def to_record(self) -> ConfigRecord:
        """As the :data:`GRID_LAYOUT` ConfigRecord."""
        record = ConfigRecord(
            {
                "names": list(self.shapes),
                "shapes": [",".join(str(d) for d in s) for s in self.shapes.values()],
                "dtypes": [str(self.dtypes[n]).removeprefix("torch.") for n in self.shapes],
            }
        )
        if self.units is not None:
            record["units"] = [self.units[n] for n in self.shapes]
        return record


def _strings(record: ConfigRecord, key: str) -> list[str]:
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{GRID_LAYOUT} key {key!r} must be a list of strings")
    return [str(v) for v in value]


def _shape(text: str) -> tuple[int, ...]:
    if text == "":
        return ()
    parts = text.split(",")
    if not all(p.isdigit() and len(p) <= 10 for p in parts):
        raise ValueError(f"{GRID_LAYOUT}: shape {text!r} is not a list of sizes")
    return tuple(int(p) for p in parts)


def parse_grid_layout(content: RecordDict) -> GridLayout:
    """Read and check the :data:`GRID_LAYOUT` record of a message.

    Raises
    ------
    ValueError
        A missing or malformed record (names repeated, lists of other lengths, a shape
        that is not a list of sizes, a dtype other than float16/32/64).
    """
    record = content.get(GRID_LAYOUT)
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"the message has no {GRID_LAYOUT!r} ConfigRecord")
    names, shapes, dtypes = (_strings(record, k) for k in ("names", "shapes", "dtypes"))
    if not len(names) == len(shapes) == len(dtypes) or len(set(names)) != len(names):
        raise ValueError(f"{GRID_LAYOUT}: names, shapes and dtypes do not match")
    if any(d not in _DTYPES for d in dtypes):
        raise ValueError(f"{GRID_LAYOUT}: dtypes {dtypes} are not all float16/32/64")
    units = record.get("units")
    if units is not None and not (
        isinstance(units, list)
        and len(units) == len(names)
        and all(isinstance(u, int) and not isinstance(u, bool) for u in units)
    ):
        raise ValueError(f"{GRID_LAYOUT} key 'units' must be one int per tensor")
    return GridLayout(
        {n: _shape(s) for n, s in zip(names, shapes, strict=True)},
        {n: _DTYPES[d] for n, d in zip(names, dtypes, strict=True)},
        None
        if units is None
        else {n: int(u) for n, u in zip(names, units, strict=True) if isinstance(u, int)},
    )
