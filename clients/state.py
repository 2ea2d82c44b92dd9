"""Persistence of a client's replica, optimiser momentum and residuals in ``context.state``.

``context.state`` is the source of truth (Flower keeps it between rounds, in simulation and
in deployment, whichever process serves the next message). It holds a *snapshot* of the
replica (weights, BatchNorm buffers, momentum) taken at some version and a *journal*: the
encoded broadcast updates applied since. Replaying the journal on the snapshot rebuilds the
replica bit for bit (the same property the server's update log relies on), so a round
writes only the small encoded update it applied; a full snapshot is written again every
:data:`JOURNAL_LIMIT` updates, after a server snapshot, or when the journal cannot be
trusted.

Records:

* ``"fedddl.replica"`` ArrayRecord: :meth:`fedddl.replica.Replica.snapshot` tensors packed
  in one byte Array (``"blob"``), layout in ``"fedddl.replica-layout"``;
* ``"fedddl.journal"`` ArrayRecord: ``"v<k>"`` → the encoded update producing version k;
* ``"fedddl.residual"`` ArrayRecord: error-feedback residuals (when enabled);
* ``"fedddl.meta"`` ConfigRecord: ``version``, ``saved-version`` (the snapshot's),
  the uplink ``compressor`` name and a random ``token`` naming this saved state.

As a speed-up, the live objects saved last are also kept in this process, one entry per
client (``key``: run and node id): :func:`load_state` takes them back only when the token
and version in ``context.state`` match, and removes them from the cache meanwhile, so a
handler that fails half-way can never leave a modified replica behind. A process serving
many clients (a simulation actor) therefore holds at most one replica per client.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from fedddl.compression import PayloadError, ResidualMemory
from fedddl.compression.downlink import decode_broadcast_parts
from fedddl.flower.records import (
    array_to_bytes,
    bytes_to_array,
    pack_tensors,
    record_to_tensors,
    tensors_to_record,
    unpack_tensors,
)
from fedddl.replica import Replica, ReplicaError
from fedddl.sync.worker import WorkerState

__all__ = ["JOURNAL_LIMIT", "ClientState", "cached_clients", "load_state", "save_state"]

REPLICA_KEY = "fedddl.replica"
JOURNAL_KEY = "fedddl.journal"
RESIDUAL_KEY = "fedddl.residual"
META_KEY = "fedddl.meta"
LAYOUT_KEY = "fedddl.replica-layout"
BLOB_KEY = "blob"

#: Encoded updates journaled before a full snapshot is written again.
JOURNAL_LIMIT = 8
_CACHE_SIZE = 256
_live: OrderedDict[Hashable, tuple[str, WorkerState]] = OrderedDict()

#: Deprecated alias of :class:`fedddl.sync.worker.WorkerState` (kept for one release).
ClientState = WorkerState


def cached_clients() -> int:
    """Clients whose live state this process holds (at most one entry per client)."""
    return len(_live)


def load_state(
    state: RecordDict,
    model_fn: Callable[[], nn.Module],
    learning_rate: float,
    momentum: float,
    *,
    key: Hashable | None = None,
) -> WorkerState:
    """Rebuild the client's state from ``context.state`` (empty → no replica).

    With ``key`` (the client's run and node id) the live objects of the matching
    :func:`save_state` are taken back instead of deserializing (see the module docstring).

    Raises
    ------
    ValueError
        If the records are malformed.
    """
    meta = state.config_records.get(META_KEY)
    residual = state.array_records.get(RESIDUAL_KEY)
    residuals = record_to_tensors(residual) if residual is not None else {}
    layout = state.config_records.get(LAYOUT_KEY)
    if meta is None or layout is None or REPLICA_KEY not in state.array_records:
        return WorkerState(None, None, ResidualMemory(residuals))
    version, saved, token = meta.get("version"), meta.get("saved-version"), meta.get("token")
    if not isinstance(version, int) or not isinstance(saved, int) or not 0 <= saved <= version:
        raise ValueError(f"context.state has bad versions {version!r} / {saved!r}")
    entry = _live.pop(key, None) if key is not None else None
    if entry is not None and entry[0] == token:
        cached = entry[1]
        if (
            cached.replica is not None
            and cached.replica.version == version
            and cached.replica.learning_rate == learning_rate
            and cached.replica.momentum == momentum
        ):
            return cached
    replica = Replica(model_fn(), learning_rate, momentum, version=0)
    blob = state.array_records[REPLICA_KEY].get(BLOB_KEY)
    if blob is None:
        raise ValueError("context.state replica record has no 'blob' Array")
    replica.load_snapshot(unpack_tensors(blob, layout), saved)
    journal = _replay(replica, state.array_records.get(JOURNAL_KEY))
    compressor = meta.get("compressor")
    name = compressor if isinstance(compressor, str) else None
    return WorkerState(replica, name, ResidualMemory(residuals), journal, saved)


def _replay(replica: Replica, record: ArrayRecord | None) -> list[tuple[int, bytes]]:
    """Apply the journaled updates in order; stop at the first that does not apply.

    A replica left behind the saved version is not an error: the client reports the
    version it reached and the server catches it up.
    """
    applied: list[tuple[int, bytes]] = []
    entries = sorted(
        (int(k[1:]), array_to_bytes(a))
        for k, a in (record or {}).items()
        if k.startswith("v") and k[1:].isdigit()
    )
    for version, payload in entries:
        if version != replica.version + 1:
            break
        try:
            update, statistics = decode_broadcast_parts(payload)
            replica.apply_update(update, version, statistics)
        except (PayloadError, ReplicaError):
            break
        applied.append((version, payload))
    return applied


def save_state(state: RecordDict, client: WorkerState, *, key: Hashable | None = None) -> None:
    """Write ``client`` into ``context.state`` (see the module docstring for what is written).

    With ``key`` the live objects are also kept in this process for the next message.
    """
    residuals = client.memory.residuals
    if residuals:
        state[RESIDUAL_KEY] = tensors_to_record(residuals)
    replica = client.replica
    if replica is None:
        return
    journal_ok = (
        client.saved_version is not None
        and len(client.journal) <= JOURNAL_LIMIT
        and client.saved_version + len(client.journal) == replica.version
        and LAYOUT_KEY in state.config_records
    )
    journal = state.array_records.get(JOURNAL_KEY)
    if not journal_ok or journal is None:
        if not journal_ok:
            blob, layout = pack_tensors(replica.snapshot(copy=False))
            state[REPLICA_KEY] = ArrayRecord({BLOB_KEY: blob})
            state[LAYOUT_KEY] = layout
            client.saved_version, client.journal = replica.version, []
        journal = state[JOURNAL_KEY] = ArrayRecord()
    wanted = {f"v{v}": p for v, p in client.journal}
    for stale in [k for k in journal if k not in wanted]:
        del journal[stale]
    for name, payload in wanted.items():  # usually one new update a round
        if name not in journal:
            journal[name] = bytes_to_array(payload)
    token = uuid.uuid4().hex
    saved = replica.version if client.saved_version is None else client.saved_version
    meta = ConfigRecord({"version": replica.version, "saved-version": saved, "token": token})
    if client.compressor is not None:
        meta["compressor"] = client.compressor
    state[META_KEY] = meta
    if key is not None:
        _live[key] = (token, client)
        _live.move_to_end(key)
        while len(_live) > _CACHE_SIZE:
            _live.popitem(last=False)
