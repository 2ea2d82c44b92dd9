"""Persistence of a ``grid`` downlink client in ``context.state``: its grid snapshot.

Records: ``"fedddl.grid"`` ArrayRecord with the replica's ``FDGS`` snapshot
(:meth:`fedddl.sync.grid_replica.GridReplica.snapshot_bytes`: anchors, counts, buffers,
version) as ``"blob"``; ``"fedddl.grid.meta"`` ConfigRecord with the uplink ``compressor``;
``"fedddl.residual"`` as :mod:`clients.state`. The snapshot rebuilds the replica bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from clients.state import RESIDUAL_KEY
from fedddl.compression import ResidualMemory
from fedddl.flower.records import (
    array_to_bytes,
    bytes_to_array,
    record_of,
    record_to_tensors,
    tensors_to_record,
)
from fedddl.sync.grid_replica import GridReplica
from fedddl.sync.worker import WorkerState

__all__ = ["load_grid_state", "save_grid_state"]

GRID_KEY = "fedddl.grid"
GRID_META_KEY = "fedddl.grid.meta"
BLOB_KEY = "blob"


def load_grid_state(state: RecordDict, model_fn: Callable[[], nn.Module]) -> WorkerState:
    """The client's state from ``context.state`` (empty: no replica).

    Raises
    ------
    ValueError
        Malformed records (a ``GridError`` for a snapshot that does not fit the model).
    """
    residual = record_of(state, RESIDUAL_KEY, ArrayRecord)
    memory = ResidualMemory(record_to_tensors(residual) if residual is not None else {})
    meta = record_of(state, GRID_META_KEY, ConfigRecord)
    compressor = meta.get("compressor") if meta is not None else None
    name = compressor if isinstance(compressor, str) else None
    record = record_of(state, GRID_KEY, ArrayRecord)
    if record is None:
        return WorkerState(None, name, memory)
    if BLOB_KEY not in record:
        raise ValueError(f"context.state {GRID_KEY!r} record has no {BLOB_KEY!r} Array")
    replica = GridReplica(model_fn())
    replica.load_snapshot_bytes(array_to_bytes(record[BLOB_KEY]))
    return WorkerState(None, name, memory, grid=replica)


def save_grid_state(state: RecordDict, client: WorkerState) -> None:
    """Write ``client`` (its grid replica, compressor, residuals) into ``context.state``."""
    residuals = client.memory.residuals
    if residuals:
        state[RESIDUAL_KEY] = tensors_to_record(residuals)
    meta = ConfigRecord({} if client.compressor is None else {"compressor": client.compressor})
    state[GRID_META_KEY] = meta
    if client.grid is not None:
        state[GRID_KEY] = ArrayRecord({BLOB_KEY: bytes_to_array(client.grid.snapshot_bytes())})
