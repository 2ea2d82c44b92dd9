"""The ``grid`` downlink of :class:`~fedddl.flower.TernaryDelta`, server side.

:class:`GridDownlink` puts the float arrays of each new global model onto the integer grid
(:class:`~fedddl.sync.grid_follower.GridFollower`: an error-fed quantized step a version,
nothing lost over rounds) and answers each node with one message
(:mod:`fedddl.flower.delta_grid_protocol`): the summed counts since the version it holds, or
the counts from the all-zero model when it holds none, is beyond the log, or that is smaller.
The broadcast model is the grid's float32 values in each array's own dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedddl.flower.delta_grid_protocol import ANCHORS_KEY, COUNTS_KEY, GridLayout
from fedddl.flower.records import bytes_to_array
from fedddl.sync.grid_follower import GridFollower

__all__ = ["GridDownlink"]


class GridDownlink:
    """One model layout's grid follower, and the records of its messages.

    Parameters
    ----------
    levels, log_size, seed : int
        As :class:`~fedddl.sync.grid_follower.GridFollower`.
    start : int
        The broadcast version before this layout's first model.
    clip_sigma : float
        Each step's exponent fits the step clipped to this many standard deviations (what
        the codes cannot carry waits in the residual); steps round to the nearest code.
    """

    def __init__(
        self, levels: int, log_size: int, seed: int, start: int, clip_sigma: float
    ) -> None:
        self.follower = GridFollower(levels, log_size, seed, start=start, clip_sigma=clip_sigma)
        self.layout: GridLayout | None = None

    @property
    def ready(self) -> bool:
        """Whether a model is on the grid."""
        return self.follower.state is not None

    def advance(self, floats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Follow ``floats`` one version; the broadcast float tensors (in their dtypes).

        Raises
        ------
        ValueError
            Values the grid cannot take (nothing changed).
        """
        self.follower.follow(floats)
        self.layout = GridLayout(
            {n: tuple(t.shape) for n, t in floats.items()}, {n: t.dtype for n, t in floats.items()}
        )
        return self.floats()

    def floats(self) -> dict[str, torch.Tensor]:
        """The broadcast float tensors, each in its array's dtype."""
        assert self.layout is not None
        dtypes = self.layout.dtypes
        return {n: v.to(dtypes[n]) for n, v in self.follower.values().items()}

    def whole_layout(self) -> GridLayout | None:
        """The layout with the units a client rebuilds the grid state from, given the whole
        model; None when it cannot (a rebase made the anchors non-zero, or a float16 array
        does not hold the float32 values exactly)."""
        follower, layout = self.follower, self.layout
        if follower.state is None or follower.rebased or layout is None:
            return None
        if any(d not in (torch.float32, torch.float64) for d in layout.dtypes.values()):
            return None
        units = follower.state.units()
        if any(u is None for u in units.values()):
            return None
        return replace(layout, units={n: int(u) for n, u in units.items() if u is not None})

    def message(self, held: int) -> tuple[int, ArrayRecord]:
        """``(base, GRID record)`` for a node holding version ``held`` (-1: none)."""
        base, data = self.follower.catch_up(held)
        arrays: dict[str, Array] = {COUNTS_KEY: bytes_to_array(data)}
        if base == -1:
            anchors = [a.reshape(-1) for a in self.follower.anchors().values()]
            flat = torch.cat(anchors) if anchors else torch.zeros(0)
            arrays[ANCHORS_KEY] = Array(np.ascontiguousarray(flat.numpy(), dtype=np.float32))
        return base, ArrayRecord(arrays)  # type: ignore[arg-type]
