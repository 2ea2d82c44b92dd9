"""Persistence of a client's replica, optimiser momentum and residuals in ``context.state``.

Records (kept between rounds by Flower, also in deployment):

* ``"fedddl.replica"`` ArrayRecord: :meth:`fedddl.replica.Replica.snapshot` tensors
  packed in one byte Array, with their layout in ``"fedddl.replica-layout"``.
* ``"fedddl.residual"`` ArrayRecord: error-feedback residuals (when enabled).
* ``"fedddl.meta"`` ConfigRecord: ``version``, the uplink ``compressor`` name and a
  random ``token`` naming this saved state.

``context.state`` is the source of truth. As a speed-up, the live objects saved last
are also kept in this process (an actor serves many rounds), keyed by the state's
``token``; :func:`load_state` takes them back only when the token and version in
``context.state`` match, and removes them from the cache meanwhile, so a handler that
fails half-way can never leave a modified replica behind.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from fedddl.compression import ResidualMemory
from fedddl.flower.records import (
    pack_tensors,
    record_to_tensors,
    tensors_to_record,
    unpack_tensors,
)
from fedddl.replica import Replica
from fedddl.sync.worker import WorkerState

__all__ = ["ClientState", "load_state", "save_state"]

REPLICA_KEY = "fedddl.replica"
RESIDUAL_KEY = "fedddl.residual"
META_KEY = "fedddl.meta"
LAYOUT_KEY = "fedddl.replica-layout"
BLOB_KEY = "blob"
_CACHE_SIZE = 256
_live: OrderedDict[str, WorkerState] = OrderedDict()

#: Deprecated alias of :class:`fedddl.sync.worker.WorkerState` (kept for one release).
ClientState = WorkerState


def load_state(
    state: RecordDict,
    model_fn: Callable[[], nn.Module],
    learning_rate: float,
    momentum: float,
    *,
    use_cache: bool = True,
) -> WorkerState:
    """Rebuild the client's state from ``context.state`` (empty → no replica).

    With ``use_cache`` the live objects of the matching :func:`save_state` are taken
    back instead of deserializing (see the module docstring).
    """
    meta = state.config_records.get(META_KEY)
    residual = state.array_records.get(RESIDUAL_KEY)
    residuals = record_to_tensors(residual) if residual is not None else {}
    layout = state.config_records.get(LAYOUT_KEY)
    if meta is None or layout is None or REPLICA_KEY not in state.array_records:
        return WorkerState(None, None, ResidualMemory(residuals))
    version = meta.get("version")
    compressor = meta.get("compressor")
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"context.state has a bad replica version {version!r}")
    token = meta.get("token")
    cached = _live.pop(token, None) if use_cache and isinstance(token, str) else None
    if (
        cached is not None
        and cached.replica is not None
        and cached.replica.version == version
        and cached.replica.learning_rate == learning_rate
        and cached.replica.momentum == momentum
    ):
        return cached
    replica = Replica(model_fn(), learning_rate, momentum, version=0)
    blob = state.array_records[REPLICA_KEY].get(BLOB_KEY)
    if blob is None:
        raise ValueError("context.state replica record has no 'blob' Array")
    replica.load_snapshot(unpack_tensors(blob, layout), version)
    name = compressor if isinstance(compressor, str) else None
    return WorkerState(replica, name, ResidualMemory(residuals))


def save_state(state: RecordDict, client: WorkerState) -> None:
    """Write ``client`` into ``context.state`` (replaces the previous records)."""
    residuals = client.memory.residuals
    if residuals:
        state[RESIDUAL_KEY] = tensors_to_record(residuals)
    if client.replica is not None:
        token = uuid.uuid4().hex
        blob, layout = pack_tensors(client.replica.snapshot(copy=False))
        state[REPLICA_KEY] = ArrayRecord({BLOB_KEY: blob})
        state[LAYOUT_KEY] = layout
        meta = ConfigRecord({"version": client.replica.version, "token": token})
        if client.compressor is not None:
            meta["compressor"] = client.compressor
        state[META_KEY] = meta
        _live[token] = client
        while len(_live) > _CACHE_SIZE:
            _live.popitem(last=False)
