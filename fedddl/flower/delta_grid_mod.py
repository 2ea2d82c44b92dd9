"""The ``grid`` downlink of :func:`~fedddl.flower.ternary_mod`, client side.

:func:`reach_grid` brings the grid model a node keeps in ``context.state`` to the message's
version (:func:`fedddl.sync.grid_holder.reach`: one count message, from the held version,
the all-zero model or the sent anchors); :func:`save_grid` keeps it as its float32 anchors
plus its counts (:data:`STATE_GRID`, :data:`STATE_GRID_LAYOUT`), which rebuild it bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedddl.compression.codecs.count_delta import MAX_COUNT, MAX_EXPONENT, MIN_EXPONENT
from fedddl.flower.delta_grid_protocol import (
    ANCHORS_KEY,
    COUNTS_KEY,
    GRID,
    GridLayout,
    parse_grid_layout,
)
from fedddl.flower.delta_protocol import Broadcast, SplitModel, split_model
from fedddl.flower.records import array_to_bytes, bytes_to_array, pack_tensors, unpack_tensors
from fedddl.sync.grid import GridError, GridState
from fedddl.sync.grid_holder import load_state, reach, state_counts

__all__ = [
    "STATE_GRID",
    "STATE_GRID_LAYOUT",
    "forget_grid",
    "reach_grid",
    "rebuild_grid",
    "save_grid",
]

#: ``context.state`` records: the anchors (packed) and counts, and the anchors' layout.
STATE_GRID = "fedddl.ternary.grid"
STATE_GRID_LAYOUT = "fedddl.ternary.grid-layout"
_ANCHORS, _COUNTS = "anchors", "counts"


def reach_grid(
    broadcast: Broadcast, content: RecordDict, state: RecordDict
) -> tuple[SplitModel, GridState]:
    """The broadcast model at ``broadcast.version`` and its grid state (not yet saved).

    Raises
    ------
    ValueError
        A message that does not fit the state held or does not decode (``GridError``).
    """
    record = content[broadcast.record]
    assert isinstance(record, ArrayRecord)  # parse_broadcast checked it
    received = split_model(record)
    layout = parse_grid_layout(content)
    if list(received.floats) or set(received.names) | set(layout.shapes) != set(
        broadcast.names
    ) or set(received.names) & set(layout.shapes):
        raise GridError("the model record must hold exactly the arrays not on the grid")
    grid = content.get(GRID)
    if not isinstance(grid, ArrayRecord) or COUNTS_KEY not in grid:
        raise GridError(f"the message has no {GRID!r} ArrayRecord with {COUNTS_KEY!r}")
    held, version = _load(state) if broadcast.base >= 1 else (None, None)
    anchors = _anchors(grid, layout) if broadcast.base == -1 else None
    reached = reach(
        held, version, broadcast.base, array_to_bytes(grid[COUNTS_KEY]), layout.shapes,
        broadcast.version, anchors,
    )  # fmt: skip
    values = reached.values()
    floats = {n: values[n].to(layout.dtypes[n]) for n in layout.shapes}
    return SplitModel(broadcast.names, floats, received.others), reached


def rebuild_grid(content: RecordDict, floats: dict[str, torch.Tensor]) -> GridState | None:
    """The grid state a whole model ``floats`` is (zero anchors, the message's units), or None
    when the message names no units.

    Raises
    ------
    GridError
        Units that do not fit (a value that is not ``counts * 2**unit`` exactly).
    """
    layout = parse_grid_layout(content)
    if layout.units is None:
        return None
    if list(layout.shapes) != [n for n in floats if n in layout.shapes] or set(
        layout.shapes
    ) != set(floats):
        raise GridError("the grid layout does not name the model's float arrays")
    state = GridState({n: torch.zeros(s, dtype=torch.float32) for n, s in layout.shapes.items()})
    for name, tensor in state.tensors.items():
        unit = layout.units[name]
        if not MIN_EXPONENT <= unit <= MAX_EXPONENT:
            raise GridError(f"{name!r}: unit {unit} out of range")
        value = floats[name].to(torch.float32)
        counts = torch.round(value.to(torch.float64) * math.ldexp(1.0, -unit))
        if counts.numel() and float(counts.abs().max()) > MAX_COUNT:
            raise GridError(f"{name!r}: counts beyond {MAX_COUNT}")
        tensor.counts, tensor.unit = counts.to(torch.int32), unit
        if not torch.equal(tensor.value(), value) or tuple(value.shape) != tensor.anchor.shape:
            raise GridError(f"{name!r} is not on the grid of unit {unit}")
    return state


def _anchors(grid: ArrayRecord, layout: GridLayout) -> dict[str, torch.Tensor]:
    array = grid.get(ANCHORS_KEY)
    if array is None:
        raise GridError(f"a message from base -1 needs {ANCHORS_KEY!r}")
    numels = [int(np.prod(s)) for s in layout.shapes.values()]
    if array.dtype != "float32" or tuple(array.shape) != (sum(numels),):
        raise GridError(f"{ANCHORS_KEY!r} must be {sum(numels)} float32 values")
    flat = torch.from_numpy(np.array(array.numpy(), dtype=np.float32, copy=True))
    if not bool(torch.isfinite(flat).all()):
        raise GridError(f"{ANCHORS_KEY!r} are not finite")
    out: dict[str, torch.Tensor] = {}
    at = 0
    for (name, shape), numel in zip(layout.shapes.items(), numels, strict=True):
        out[name] = flat[at : at + numel].reshape(shape).clone()
        at += numel
    return out


def save_grid(state: RecordDict, grid: GridState, version: int) -> None:
    """Keep ``grid`` at ``version`` in ``state``."""
    blob, layout = pack_tensors(grid.anchors())
    counts = bytes_to_array(state_counts(grid, version))
    state[STATE_GRID] = ArrayRecord({_ANCHORS: blob, _COUNTS: counts})  # type: ignore[arg-type]
    state[STATE_GRID_LAYOUT] = layout


def _load(state: RecordDict) -> tuple[GridState | None, int | None]:
    record, layout = state.get(STATE_GRID), state.get(STATE_GRID_LAYOUT)
    if not (
        isinstance(record, ArrayRecord)
        and isinstance(layout, ConfigRecord)
        and _ANCHORS in record
        and _COUNTS in record
    ):
        return None, None
    anchors = unpack_tensors(record[_ANCHORS], layout)
    return load_state(anchors, array_to_bytes(record[_COUNTS]))


def forget_grid(state: RecordDict) -> None:
    """Drop the grid state from ``state``."""
    for key in (STATE_GRID, STATE_GRID_LAYOUT):
        if key in state:
            del state[key]
