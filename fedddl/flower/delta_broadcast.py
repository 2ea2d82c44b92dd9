"""The downlink of :class:`~fedddl.flower.TernaryDelta`: the broadcast model and its log.

:class:`DeltaBroadcast` keeps the model the nodes hold (the *broadcast model*) and moves it
towards each new global model by ``steps`` ternary-encoded deltas (one version each) of the
whole gap (what one delta could not carry goes with the next). The encoded deltas are kept in an
:class:`~fedddl.replica.UpdateLog` and a node's message is planned by
:func:`~fedddl.replica.plan_catch_up`, as TernGrad plans its catch-ups: the deltas a node
misses, or the whole model when the log does not reach back far enough.

The broadcast model keeps the dtypes of the first global model it was sent: when the
wrapped strategy returns its model in another float dtype (FedAdam and QFedAvg turn float32
into float64), the deltas (or the grid's targets) are cast to the broadcast model's dtypes
and the nodes keep receiving deltas; only another layout (names, shapes, integer arrays)
starts anew.

With ``downlink="grid"`` the float arrays live on an integer grid instead
(:class:`~fedddl.flower.delta_grid.GridDownlink`): each node gets one message of summed
integer counts, never a whole fp32 model (a model the grid cannot take is sent whole once).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log

from fedddl.compression import decode_update, encode_update, limits_for, make_compressor
from fedddl.flower.delta_admission import Layout, layout_of
from fedddl.flower.delta_grid import GridDownlink
from fedddl.flower.delta_grid_protocol import GRID, GRID_LAYOUT, GridLayout
from fedddl.flower.delta_protocol import (
    META,
    UPDATES,
    Broadcast,
    SplitModel,
    digest,
    join_model,
    split_model,
    update_key,
)
from fedddl.flower.records import bytes_to_array
from fedddl.replica import CatchUp, UpdateLog, plan_catch_up
from fedddl.seeding import derive_seed
from fedddl.sync.grid_log import MAX_CAPACITY

__all__ = ["DOWNLINKS", "DeltaBroadcast", "downlink_mode"]

#: The downlink modes: ternary deltas with a log of them, the integer grid, whole models.
DOWNLINKS = ("delta", "grid", "none")


class DeltaBroadcast:
    """The broadcast model, the exact global model it follows, and the log of deltas.

    ``steps`` deltas (versions) per new global model; the log keeps ``update_log_size``
    global models' worth of them.

    Attributes
    ----------
    version : int
        Deltas and whole models broadcast so far (0: none yet).
    downlink : str
        One of :data:`DOWNLINKS`.
    names, floats, others, exact, layout
        The broadcast model (array names in order, float tensors, other Arrays), the exact
        global model's float tensors, and the global model's layout.
    """

    def __init__(
        self,
        compressor: str,
        clip_sigma: float,
        error_feedback: bool,
        downlink: str,
        update_log_size: int,
        seed: int,
        grid_levels: int = 1,
        grid_log_size: int = 64,
        steps: int = 1,
        scale_bucket: int = 0,
    ) -> None:
        if downlink not in DOWNLINKS:
            raise ValueError(f"downlink must be one of {DOWNLINKS}, got {downlink!r}")
        self.compressor, self.clip_sigma, self.seed = compressor, float(clip_sigma), seed
        self.scale_bucket = scale_bucket
        self.error_feedback, self.downlink = error_feedback, downlink
        self.threshold: float | None = None  # the uplink's cut told to the nodes (None: own)
        self.grid_levels, self.grid_log_size = grid_levels, grid_log_size
        self._grid: GridDownlink | None = None
        self.version = 0
        self.names: list[str] = []
        self.floats: dict[str, torch.Tensor] = {}
        self.exact: dict[str, torch.Tensor] = {}
        self.others: dict[str, Array] = {}
        self.layout: Layout = {}
        self._digest = ""
        self._target = ""
        self.steps = steps
        #: The version the latest update starts from (the previous global model's; -1: none).
        self.latest_base = -1
        self._log = UpdateLog(update_log_size * steps)

    def model(self) -> ArrayRecord | None:
        """The broadcast model as an ArrayRecord (None before the first)."""
        if not self.names:
            return None
        return join_model(self.names, self.floats, self.others)

    def advance(self, arrays: ArrayRecord) -> None:
        """Move the broadcast model towards ``arrays`` (once per distinct global model)."""
        target = split_model(arrays)
        fingerprint = _fingerprint(target)
        if fingerprint == self._target:
            return  # e.g. the evaluation and the next training of one global model
        self._target = fingerprint
        layout = layout_of(arrays)
        if self.downlink == "grid":
            self._advance_grid(target, layout, not self._follows(target, layout))
            return
        fresh = self.downlink == "none" or not self._follows(target, layout)
        self.layout, self.others, self.exact = layout, target.others, target.floats
        base = self.version
        if not fresh:
            fresh = not self._step(target.floats)
            for _ in range(1, self.steps):  # more deltas towards the same model
                if fresh:
                    break
                self.version += 1
                fresh = not self._step(target.floats)
        if fresh:
            self.names = target.names
            self.floats = {n: t.clone() for n, t in target.floats.items()}
            self._log.clear()
        self.version += 1
        self.latest_base = base
        self._digest = digest(self.floats)

    def _follows(self, target: SplitModel, layout: Layout) -> bool:
        """Whether ``target`` can follow the broadcast model by a delta: the same names and
        shapes, the same float arrays, the same other arrays (float dtypes may differ)."""
        if not self.names or target.names != self.names:
            return False
        if list(target.floats) != list(self.floats):
            return False
        return all(
            layout[n][1] == self.layout[n][1]
            and (n in target.floats or layout[n] == self.layout[n])
            for n in self.names
        )

    def _advance_grid(self, target: SplitModel, layout: Layout, fresh: bool) -> None:
        """:meth:`advance` of the ``grid`` downlink; a model the grid cannot take leaves the
        broadcast model as it is (or, with none yet, is sent whole)."""
        self.layout, self.others, self.exact = layout, target.others, target.floats
        grid = self._grid
        if fresh or grid is None:
            grid = GridDownlink(
                self.grid_levels, self.grid_log_size, self.seed, self.version, self.clip_sigma
            )
        wanted = target.floats
        if not fresh:  # in the broadcast model's dtypes, whatever the strategy's
            wanted = {n: t.to(self.floats[n].dtype) for n, t in wanted.items()}
        try:
            floats = grid.advance(wanted)
        except ValueError as err:
            if not fresh and grid.ready:
                log(logging.WARNING, "TernaryDelta keeps the broadcast model: %s", err)
                return
            log(logging.WARNING, "TernaryDelta sends the whole model: %s", err)
            grid = GridDownlink(
                self.grid_levels, self.grid_log_size, self.seed, self.version + 1, self.clip_sigma
            )
            floats = {n: t.clone() for n, t in target.floats.items()}
        self._grid = grid
        self.names, self.floats = target.names, floats
        self.latest_base = self.version
        self.version += 1
        self._digest = digest(self.floats)

    def costly(self, held: int) -> bool:
        """Whether a node holding ``held`` needs a resync: more than the latest update (the
        ``steps`` deltas from :attr:`latest_base`)."""
        if held != self.latest_base or self.downlink == "none":
            return held != self.version
        if self.downlink == "grid":
            return self._grid is None or not self._grid.ready or self._grid.message(held)[0] < 1
        return plan_catch_up(held, self.version, self._log).kind == "snapshot"

    def _step(self, target: dict[str, torch.Tensor]) -> bool:
        """Move the broadcast model by one encoded delta of the whole gap to ``target``
        (what earlier deltas could not carry is part of it) as version ``version + 1``;
        False when the gap cannot be encoded (e.g. a non-finite model)."""
        delta = {  # in the broadcast model's dtypes, whatever the strategy's
            n: (target[n] - self.floats[n]).to(self.floats[n].dtype) for n in self.floats
        }
        compressor = make_compressor(
            self.compressor,
            seed=derive_seed(self.seed, 0x5E4D, self.version + 1),
            clip_sigma=self.clip_sigma,
            scale_bucket=self.scale_bucket,
        )
        try:
            payload = encode_update(delta, compressor)
        except ValueError as err:  # e.g. a non-finite model: send it whole
            log(logging.WARNING, "TernaryDelta sends the whole model: %s", err)
            return False
        decoded = decode_update(payload, **limits_for(delta))  # what every client will add
        self.floats = {n: self.floats[n] + decoded[n] for n in self.floats}
        self._log.append(self.version + 1, payload)
        return True

    def content_for(
        self, held: int, content: RecordDict, key: str, whole: bool = False
    ) -> RecordDict:
        """``content`` with its model record ``key`` replaced by what a node that holds
        version ``held`` (-1: none) needs (``whole``: the whole model), and the :data:`META`
        record."""
        if not -1 <= held <= self.version:
            held = -1  # a version never broadcast: the node holds nothing usable
        grid = self._grid
        if self.downlink == "grid" and grid is not None and grid.ready and not whole:
            return self._grid_content(held, content, key)
        catch_up = (
            plan_catch_up(held, self.version, self._log)
            if self.downlink == "delta" and not whole
            else CatchUp("snapshot", [])
        )
        delta = catch_up.kind != "snapshot"
        out = RecordDict()
        for name, record in content.items():
            if name == key:
                record = (
                    ArrayRecord(dict(self.others))  # type: ignore[arg-type]
                    if delta
                    else join_model(self.names, self.floats, self.others)
                )
            out[name] = record
        if delta:
            updates = {update_key(v): bytes_to_array(p) for v, p in catch_up.updates}
            out[UPDATES] = ArrayRecord(updates)  # type: ignore[arg-type]
        rebuild = self.whole_rebuilds_grid() if self.downlink == "grid" else None
        if rebuild is not None:
            out[GRID_LAYOUT] = rebuild.to_record()
        out[META] = self._meta(key, held if delta else -1)
        return out

    def whole_rebuilds_grid(self) -> GridLayout | None:
        """``grid``: the layout (with units) a whole model lets a client rebuild its grid
        state from, if it can."""
        grid = self._grid
        return None if grid is None or not grid.ready else grid.whole_layout()

    def _grid_content(self, held: int, content: RecordDict, key: str) -> RecordDict:
        """:meth:`content_for` of the ``grid`` downlink: one count message."""
        assert self._grid is not None and self._grid.layout is not None
        base, record = self._grid.message(held)
        out = RecordDict()
        for name, found in content.items():
            out[name] = ArrayRecord(dict(self.others)) if name == key else found  # type: ignore[arg-type]
        out[GRID] = record
        out[GRID_LAYOUT] = self._grid.layout.to_record()
        out[META] = self._meta(key, base)
        return out

    def _meta(self, key: str, base: int) -> ConfigRecord:
        return Broadcast(
            record=key,
            names=list(self.names),
            version=self.version,
            base=base,
            digest=self._digest,
            compressor=self.compressor,
            clip_sigma=self.clip_sigma,
            error_feedback=self.error_feedback,
            seed=self.seed,
            scale_bucket=self.scale_bucket,
            threshold=self.threshold,
        ).to_record()


def downlink_mode(
    downlink: bool | str, grid_levels: int, grid_log_size: int, resync_interval: int
) -> str:
    """The downlink mode of :class:`TernaryDelta`'s settings (checked)."""
    mode = ("delta" if downlink else "none") if isinstance(downlink, bool) else downlink
    if mode not in DOWNLINKS:
        raise ValueError(
            f"downlink must be True, False or one of {', '.join(DOWNLINKS)}, got {downlink!r}"
        )
    for name, value, most in (("grid_levels", grid_levels, 127),
                              ("grid_log_size", grid_log_size, MAX_CAPACITY)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ValueError(f"{name} must be an int in [1, {most}], got {value!r}")
    if isinstance(resync_interval, bool) or not isinstance(resync_interval, int) or (
        resync_interval < 0
    ):
        raise ValueError(f"resync_interval must be an int >= 0, got {resync_interval!r}")
    return str(mode)


def _fingerprint(model: SplitModel) -> str:
    """The fingerprint of a whole model: its float tensors and its other Arrays (their
    serialized bytes, whatever their dtype and serialization)."""
    tensors = dict(model.floats)
    for name, array in model.others.items():
        key = f"{name}|{array.dtype}|{list(array.shape)}|{array.stype}"
        tensors[key] = torch.from_numpy(np.frombuffer(array.data, dtype=np.uint8).copy())
    return digest(tensors)
