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
  the uplink ``compressor`` name, a random ``token`` naming this saved state and a random
  ``lineage`` naming the chain of replicas it descends from (new whenever the replica
  starts afresh or from a server snapshot; kept when the journal is folded into a new
  snapshot, which changes the records but not the replica).

As a speed-up, the live objects saved last are also kept in this process, one entry per
client (``key``: run and node id), and :func:`load_state` removes them from the cache
while a handler runs, so a handler that fails half-way can never leave a modified replica
behind. A process serving many clients (a simulation actor) therefore holds at most one
replica per client. The cached replica is taken back

* as it is when the token and version in ``context.state`` match (this process saved the
  state last), or
* *caught up* when another process served the client since (Flower's simulation actors
  have no client affinity): same lineage, a version between the snapshot's and the saved
  one, and the journal holds every later update. Every replica of a lineage at version k
  is the global model at version k, so applying the journaled updates after its version
  gives bit for bit the replica a rebuild from the snapshot gives, without rebuilding.
  Anything that does not apply falls back to the rebuild.
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
    record_of,
    record_to_tensors,
    tensors_to_record,
    unpack_tensors,
)
from fedddl.lr_decay import NO_DECAY, StepDecay
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
_live: OrderedDict[Hashable, tuple[str, str, WorkerState]] = OrderedDict()

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
    lr_decay: StepDecay = NO_DECAY,
) -> WorkerState:
    """Rebuild the client's state from ``context.state`` (empty → no replica).

    With ``key`` (the client's run and node id) the live objects of the matching
    :func:`save_state` are taken back instead of deserializing (see the module docstring).

    Raises
    ------
    ValueError
        If the records are malformed.
    """
    meta = record_of(state, META_KEY, ConfigRecord)
    residual = record_of(state, RESIDUAL_KEY, ArrayRecord)
    residuals = record_to_tensors(residual) if residual is not None else {}
    layout = record_of(state, LAYOUT_KEY, ConfigRecord)
    snapshot = record_of(state, REPLICA_KEY, ArrayRecord)
    if meta is None or layout is None or snapshot is None:
        return WorkerState(None, None, ResidualMemory(residuals))
    version, saved, token = meta.get("version"), meta.get("saved-version"), meta.get("token")
    if not isinstance(version, int) or not isinstance(saved, int) or not 0 <= saved <= version:
        raise ValueError(f"context.state has bad versions {version!r} / {saved!r}")
    compressor = meta.get("compressor")
    name = compressor if isinstance(compressor, str) else None
    entry = _live.pop(key, None) if key is not None else None
    if entry is not None:
        cached_token, lineage, cached = entry
        replica = cached.replica
        if (
            replica is not None
            and replica.learning_rate == learning_rate
            and replica.momentum == momentum
            and replica.lr_decay == lr_decay
        ):
            if cached_token == token and replica.version == version:
                return cached
            if lineage == meta.get("lineage") and saved <= replica.version < version:
                caught_up = _catch_up(replica, state, saved, version)
                if caught_up is not None:
                    return WorkerState(replica, name, ResidualMemory(residuals), caught_up, saved)
    replica = Replica(model_fn(), learning_rate, momentum, version=0, lr_decay=lr_decay)
    blob = snapshot.get(BLOB_KEY)
    if blob is None:
        raise ValueError("context.state replica record has no 'blob' Array")
    replica.load_snapshot(unpack_tensors(blob, layout), saved)
    journal = _replay(replica, _journal_entries(state))
    return WorkerState(replica, name, ResidualMemory(residuals), journal, saved)


def _journal_entries(state: RecordDict) -> list[tuple[int, bytes]]:
    """The journaled ``(version, payload)`` pairs in ``context.state``, oldest first."""
    record = record_of(state, JOURNAL_KEY, ArrayRecord)
    return sorted(
        (int(k[1:]), array_to_bytes(a))
        for k, a in (record or {}).items()
        if k.startswith("v") and k[1:].isdigit()
    )


def _catch_up(
    replica: Replica, state: RecordDict, saved: int, version: int
) -> list[tuple[int, bytes]] | None:
    """Apply the journaled updates after ``replica.version`` up to ``version``.

    Returns the whole journal (every update since ``saved``), or None when the journal is
    not exactly the updates ``saved + 1 .. version`` or one of them does not apply (the
    replica may then be half-way: the caller rebuilds from the snapshot).
    """
    entries = _journal_entries(state)
    if [v for v, _ in entries] != list(range(saved + 1, version + 1)):
        return None
    _replay(replica, entries[replica.version - saved :])
    return entries if replica.version == version else None


def _replay(replica: Replica, entries: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """Apply the journaled updates in order; stop at the first that does not apply.

    A replica left behind the saved version is not an error: the client reports the
    version it reached and the server catches it up.
    """
    applied: list[tuple[int, bytes]] = []
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
        and record_of(state, LAYOUT_KEY, ConfigRecord) is not None
    )
    old_meta = record_of(state, META_KEY, ConfigRecord)
    lineage = None if old_meta is None else old_meta.get("lineage")
    if client.saved_version is None or not isinstance(lineage, str):
        lineage = uuid.uuid4().hex  # a fresh replica or a server snapshot starts a lineage
    journal = record_of(state, JOURNAL_KEY, ArrayRecord)
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
    meta = ConfigRecord(
        {"version": replica.version, "saved-version": saved, "token": token, "lineage": lineage}
    )
    if client.compressor is not None:
        meta["compressor"] = client.compressor
    state[META_KEY] = meta
    if key is not None:
        _live[key] = (token, lineage, client)
        _live.move_to_end(key)
        while len(_live) > _CACHE_SIZE:
            _live.popitem(last=False)
