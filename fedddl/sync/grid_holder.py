"""A holder of a :class:`~fedddl.sync.grid_follower.GridFollower`'s model: apply its messages.

:func:`reach` applies one count-delta message (:mod:`fedddl.compression.codecs.counts`) from
a base: ``base >= 1`` to the state held at that version, ``0`` to the all-zero state,
``-1`` to the given anchors with zero counts. Decoding is bounded by the layout
(:func:`message_limit`) and all or nothing; the result equals the follower's state bit for
bit. :func:`state_counts` and :func:`load_state` keep a state as its anchors plus the counts
from version 0 (the same message a follower sends a holder without state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedddl.compression import PayloadError
from fedddl.compression.codecs.count_delta import CountDelta, Layout
from fedddl.compression.codecs.counts import decode_counts, encode_counts
from fedddl.sync.grid import GridError, GridState

__all__ = ["MAX_SEGMENTS", "load_state", "message_limit", "reach", "state_counts"]

#: Segments a message may carry (one per rebase in the stretch, plus one).
MAX_SEGMENTS = 64


def message_limit(layout: Layout) -> int:
    """The most bytes a count-delta message for ``layout`` may take."""
    numel = sum(math.prod(shape) for shape in layout.values())
    return MAX_SEGMENTS * (5 * numel + 3 * len(layout) + 1) + 4096


def _decode(data: bytes, layout: Layout) -> CountDelta:
    try:
        return decode_counts(data, layout, message_limit(layout))
    except PayloadError as err:
        raise GridError(f"grid message: {err}") from err


def reach(
    held: GridState | None,
    held_version: int | None,
    base: int,
    data: bytes,
    layout: Layout,
    version: int,
    anchors: Mapping[str, torch.Tensor] | None = None,
) -> GridState:
    """The state at ``version`` after the message ``data`` from ``base`` (``held`` is not
    changed).

    Raises
    ------
    GridError
        A base this holder does not hold, anchors missing or of another layout (base -1),
        or a message that does not decode, start at the base, end at ``version`` or apply.
    """
    if base >= 1:
        if held is None or held_version != base:
            raise GridError(
                f"grid message: it starts from version {base}, this holder has "
                f"{'none' if held is None else held_version}"
            )
        if held.layout != dict(layout):
            raise GridError("grid message: the held state's tensors are not the message's")
        start = held
    elif base == 0:
        start = GridState({n: torch.zeros(s, dtype=torch.float32) for n, s in layout.items()})
    elif base == -1:
        if anchors is None or {n: tuple(a.shape) for n, a in anchors.items()} != dict(layout):
            raise GridError("grid message: its anchors are missing or not of its tensors")
        start = GridState(anchors)
    else:
        raise GridError(f"grid message: base {base}")
    delta = _decode(data, layout)
    first = max(base, 0)
    if delta.from_version != first or delta.to_version != version:
        raise GridError(
            f"grid message: it goes from version {delta.from_version} to {delta.to_version}, "
            f"expected {first} to {version}"
        )
    state = start.copy()
    state.apply_catch_up(delta)
    return state


def state_counts(state: GridState, version: int) -> bytes:
    """``state``'s counts as one count-delta message from version 0 to ``version``."""
    delta = CountDelta(0, version, (state.snapshot_segment(),))
    return encode_counts(delta, state.layout)


def load_state(
    anchors: Mapping[str, torch.Tensor], data: bytes
) -> tuple[GridState, int]:
    """The state (and version) :func:`state_counts` wrote, on ``anchors``.

    Raises
    ------
    GridError
        Counts that do not decode for the anchors' layout.
    """
    layout = {n: tuple(a.shape) for n, a in anchors.items()}
    delta = _decode(data, layout)
    if delta.from_version != 0 or len(delta.segments) != 1 or delta.segments[0].rebase:
        raise GridError("grid state: the counts must be one segment from version 0")
    state = GridState(anchors)
    state.apply(delta.segments[0])
    return state, delta.to_version
