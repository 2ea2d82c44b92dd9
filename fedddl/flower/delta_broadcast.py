"""The downlink of :class:`~fedddl.flower.TernaryDelta`: the broadcast model and its log.

:class:`DeltaBroadcast` keeps the model the nodes hold (the *broadcast model*) and moves it
towards each new global model by one ternary-encoded delta of the whole gap (what one delta
could not carry goes with the next). The encoded deltas are kept in an
:class:`~fedddl.replica.UpdateLog` and a node's message is planned by
:func:`~fedddl.replica.plan_catch_up`, as TernGrad plans its catch-ups: the deltas a node
misses, or the whole model when the log does not reach back far enough.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.common.logger import log

from fedddl.compression import decode_update, encode_update, limits_for, make_compressor
from fedddl.flower.delta_admission import Layout, layout_of
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

__all__ = ["DeltaBroadcast"]


class DeltaBroadcast:
    """The broadcast model, the exact global model it follows, and the log of deltas.

    Attributes
    ----------
    version : int
        Deltas and whole models broadcast so far (0: none yet).
    names, floats, others, exact, layout
        The broadcast model (array names in order, float tensors, other Arrays), the exact
        global model's float tensors, and the global model's layout.
    """

    def __init__(
        self,
        compressor: str,
        clip_sigma: float,
        error_feedback: bool,
        downlink: bool,
        update_log_size: int,
        seed: int,
        scale_bucket: int = 0,
    ) -> None:
        self.compressor, self.clip_sigma, self.seed = compressor, float(clip_sigma), seed
        self.scale_bucket = scale_bucket
        self.error_feedback, self.downlink = error_feedback, downlink
        self.version = 0
        self.names: list[str] = []
        self.floats: dict[str, torch.Tensor] = {}
        self.exact: dict[str, torch.Tensor] = {}
        self.others: dict[str, Array] = {}
        self.layout: Layout = {}
        self._digest = ""
        self._target = ""
        self._log = UpdateLog(update_log_size)

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
        fresh = not self.names or layout != self.layout or not self.downlink
        self.layout, self.others, self.exact = layout, target.others, target.floats
        if not fresh:
            # the whole gap: what earlier deltas could not carry is part of it
            delta = {n: target.floats[n] - self.floats[n] for n in self.floats}
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
                fresh = True
            else:
                decoded = decode_update(payload, **limits_for(delta))  # what every client will add
                self.floats = {n: self.floats[n] + decoded[n] for n in self.floats}
                self._log.append(self.version + 1, payload)
        if fresh:
            self.names = target.names
            self.floats = {n: t.clone() for n, t in target.floats.items()}
            self._log.clear()
        self.version += 1
        self._digest = digest(self.floats)

    def content_for(self, held: int, content: RecordDict, key: str) -> RecordDict:
        """``content`` with its model record ``key`` replaced by what a node that holds
        version ``held`` (-1: none) needs, and the :data:`META` record."""
        catch_up = (
            plan_catch_up(held, self.version, self._log)
            if self.downlink
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
        out[META] = Broadcast(
            record=key,
            names=list(self.names),
            version=self.version,
            base=held if delta else -1,
            digest=self._digest,
            compressor=self.compressor,
            clip_sigma=self.clip_sigma,
            error_feedback=self.error_feedback,
            seed=self.seed,
            scale_bucket=self.scale_bucket,
        ).to_record()
        return out


def _fingerprint(model: SplitModel) -> str:
    """The fingerprint of a whole model: its float tensors and its other Arrays."""
    tensors = dict(model.floats)
    for name, array in model.others.items():
        tensors[name] = torch.from_numpy(np.array(array.numpy(), copy=True))
    return digest(tensors)
