"""Persistence of a client's replica, optimiser momentum and residuals in ``context.state``.

``context.state`` (kept by Flower between rounds, whichever process serves the next
message) holds a *snapshot* of the replica taken at some version and a *journal*: the
encoded broadcast updates applied since, replayed onto the snapshot bit for bit
(:func:`fedddl.sync.journal.replay`). A full snapshot is written again every
:data:`JOURNAL_LIMIT` updates, after a server snapshot, when the journal cannot be
trusted, or, with snapshot files, once the journal's bytes exceed half the snapshot's
(fp32 updates: every update, so ``context.state`` never carries model-sized updates).
Records:

* ``"fedddl.replica"`` ArrayRecord: the packed snapshot (``"blob"``), unless it is in a file
  (:mod:`clients.snapshot_files`);
* ``"fedddl.residual"`` ArrayRecord: error-feedback residuals (when enabled);
* ``"fedddl.meta"`` ConfigRecord, everything a round changes: ``version``,
  ``saved-version``, ``compressor``, ``layout`` (JSON), ``journal`` (the updates producing
  versions ``saved-version + 1`` to ``version``) and ``chains``, the *history digests*.

A history digest names the exact sequence of states a replica went through (the snapshot,
then each update, :func:`extend_chain`): two replicas with the same digest hold the same
state bit for bit. A process keeps the live replica saved last per run (``key``), which
:func:`load_state` takes instead of deserializing when the client's digest shows it is the
same replica, one its journal catches up, or one ahead by the updates the client's message
brings; anything else is rebuilt from the records.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from clients.snapshot_files import FILE_KEYS, read_snapshot, write_snapshot
from fedddl.compression import ResidualMemory
from fedddl.flower.records import (
    array_to_bytes,
    bytes_to_array,
    pack_tensors,
    record_of,
    save_residuals,
    saved_residuals,
    unpack_tensors,
)
from fedddl.lr_decay import NO_DECAY, StepDecay
from fedddl.replica import Replica
from fedddl.sync.journal import replay
from fedddl.sync.worker import WorkerState

__all__ = [
    "JOURNAL_FOLD_SHARE",
    "JOURNAL_LIMIT",
    "cached_replicas",
    "extend_chain",
    "journal_bytes",
    "load_state",
    "save_state",
    "snapshot_chain",
    "tensor_bytes",
]

REPLICA_KEY = "fedddl.replica"
RESIDUAL_KEY = "fedddl.residual"
META_KEY = "fedddl.meta"
BLOB_KEY = "blob"

#: Encoded updates journaled before a full snapshot is written again (also the number of
#: versions a shared replica remembers).
JOURNAL_LIMIT = 8
#: With snapshot files, a journal holding more bytes than this share of a snapshot is folded
#: into a new snapshot file.
JOURNAL_FOLD_SHARE = 0.5
_RUNS_KEPT = 4
_DIGEST_BYTES = 16


def snapshot_chain(version: int, blob: bytes) -> str:
    """History digest of a replica saved as ``blob`` (packed snapshot bytes) at ``version``."""
    digest = hashlib.blake2b(b"fedddl-snapshot", digest_size=_DIGEST_BYTES)
    digest.update(version.to_bytes(8, "little"))
    digest.update(blob)
    return digest.hexdigest()


def extend_chain(chain: str, version: int, payload: bytes) -> str:
    """History digest after applying the encoded update ``payload`` producing ``version``."""
    digest = hashlib.blake2b(bytes.fromhex(chain), digest_size=_DIGEST_BYTES)
    digest.update(version.to_bytes(8, "little"))
    digest.update(payload)
    return digest.hexdigest()


@dataclass
class _Shared:
    """A run's live replica in this process and its recent history.

    ``history[k] = (digest at version k, encoded update producing k or None)``.
    """

    replica: Replica
    history: dict[int, tuple[str, bytes | None]]
    version: int = field(init=False)  # the replica's version when kept (``history`` ends there)

    def __post_init__(self) -> None:
        self.version = self.replica.version


@dataclass
class _Loaded(WorkerState):
    """A :class:`WorkerState` whose replica is this process's shared one, with its history."""

    history: dict[int, tuple[str, bytes | None]] = field(default_factory=dict)


_shared: OrderedDict[Hashable, _Shared] = OrderedDict()


def cached_replicas() -> int:
    """Live replicas this process keeps between messages (at most one per run)."""
    return len(_shared)


def load_state(
    state: RecordDict,
    model_fn: Callable[[], nn.Module],
    learning_rate: float,
    momentum: float,
    *,
    key: Hashable | None = None,
    lr_decay: StepDecay = NO_DECAY,
    updates: Mapping[int, bytes] | None = None,
    target: int | None = None,
    snapshot_dir: Path | None = None,
) -> WorkerState:
    """Rebuild the client's state from ``context.state`` (empty → no replica).

    With ``key`` (the client's run) the process's live replica of that run is taken
    instead of deserializing when the history digests allow (see the module docstring);
    ``updates`` (version → encoded update, from the client's message) and ``target`` (the
    version the message asks for) allow adopting a replica that is ahead of the client.
    ``snapshot_dir`` is where :func:`save_state` wrote the snapshot, if not in the records
    (a missing or altered file: no replica, the client asks the server for a snapshot).

    Raises
    ------
    ValueError
        If the records are malformed.
    """
    meta = record_of(state, META_KEY, ConfigRecord)
    residuals = saved_residuals(state, RESIDUAL_KEY)
    snapshot = record_of(state, REPLICA_KEY, ArrayRecord)
    if meta is None:
        return WorkerState(None, None, ResidualMemory(residuals))
    version, saved = meta.get("version"), meta.get("saved-version")
    if not isinstance(version, int) or not isinstance(saved, int) or not 0 <= saved <= version:
        raise ValueError(f"context.state has bad versions {version!r} / {saved!r}")
    compressor = meta.get("compressor")
    name = compressor if isinstance(compressor, str) else None
    entries = _journal_entries(meta.get("journal", []), saved)
    chains = _chains(meta.get("chains"), saved, version, entries)
    shared = _shared.pop(key, None) if key is not None and chains is not None else None
    if shared is not None and chains is not None:
        if _fits(shared.replica, learning_rate, momentum, lr_decay):
            taken = _take(shared, chains, entries, saved, version, updates, target)
            if taken is not None:
                journal, chains = taken
                return _Loaded(
                    shared.replica, name, ResidualMemory(residuals), journal, saved,
                    chains, shared.history,
                )  # fmt: skip
        if shared.replica.version == shared.version:  # untouched: back for the next client
            _shared.setdefault(key, shared)
    if snapshot is not None:
        blob = snapshot.get(BLOB_KEY)
        if blob is None:
            raise ValueError("context.state replica record has no 'blob' Array")
    else:  # in a snapshot file, if this machine has it
        data = read_snapshot(snapshot_dir, meta) if snapshot_dir is not None else None
        blob = None if data is None else bytes_to_array(data)
    layout = _layout(meta.get("layout"))
    if layout is None or blob is None:  # nothing to rebuild from: the server sends a snapshot
        return WorkerState(None, name, ResidualMemory(residuals))
    replica = Replica(model_fn(), learning_rate, momentum, version=0, lr_decay=lr_decay)
    replica.load_snapshot(unpack_tensors(blob, layout), saved)
    journal = list(replay(replica, entries))
    kept = chains[: len(journal) + 1] if chains is not None else []
    return WorkerState(replica, name, ResidualMemory(residuals), journal, saved, kept)


def _fits(replica: Replica, learning_rate: float, momentum: float, lr_decay: StepDecay) -> bool:
    return (
        replica.learning_rate == learning_rate
        and replica.momentum == momentum
        and replica.lr_decay == lr_decay
    )


def _take(
    shared: _Shared,
    chains: list[str],
    entries: list[tuple[int, bytes]],
    saved: int,
    version: int,
    updates: Mapping[int, bytes] | None,
    target: int | None,
) -> tuple[list[tuple[int, bytes]], list[str]] | None:
    """Take the run's live replica for a client at ``version`` (see the module docstring).

    Returns the client's journal and digests to go with it, or None: the replica was not
    touched, or was left half-way by a journaled update that does not apply (then
    ``shared.replica.version != shared.version`` and the caller drops it).
    """
    replica = shared.replica
    at = replica.version
    mine = shared.history.get(at, ("", None))[0]
    if saved <= at <= version and mine == chains[at - saved]:
        list(replay(replica, entries[at - saved :]))
        return (entries, chains) if replica.version == version else None
    if at <= version or updates is None or target is None or at > target:
        return None
    if shared.history.get(version, ("", None))[0] != chains[-1]:
        return None
    adopted: list[tuple[int, bytes]] = []
    for v in range(version + 1, at + 1):
        payload = shared.history.get(v, ("", None))[1]
        if payload is None or updates.get(v) != payload:
            return None
        adopted.append((v, payload))
    return entries + adopted, chains + [shared.history[v][0] for v, _ in adopted]


def _chains(
    value: object, saved: int, version: int, entries: list[tuple[int, bytes]]
) -> list[str] | None:
    """The stored digests if they fit the journal (one per version saved..version)."""
    if (
        not isinstance(value, list)
        or len(value) != version - saved + 1
        or [v for v, _ in entries] != list(range(saved + 1, version + 1))
        or not all(isinstance(c, str) and len(c) == 2 * _DIGEST_BYTES for c in value)
    ):
        return None
    try:
        bytes.fromhex("".join(value))
    except ValueError:
        return None
    return list(value)


def _journal_entries(value: object, saved: int) -> list[tuple[int, bytes]]:
    """The journaled ``(version, payload)`` pairs (``value``: the meta's ``journal``)."""
    if not isinstance(value, list) or not all(isinstance(p, bytes) for p in value):
        raise ValueError("context.state journal is not a list of encoded updates")
    return [(saved + 1 + i, payload) for i, payload in enumerate(value)]


def _layout_text(layout: ConfigRecord) -> str:
    """The snapshot's tensor layout (from :func:`pack_tensors`) as one string.

    One string, not four lists, so that carrying it over every round costs one value
    check (ConfigRecord checks every key and list item it is given).
    """
    return json.dumps(dict(layout), separators=(",", ":"))


def _layout(value: object) -> ConfigRecord | None:
    """Inverse of :func:`_layout_text`; None if absent.

    Raises
    ------
    ValueError
        If the text is not a layout.
    """
    if value is None:
        return None
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
        if not isinstance(parsed, dict):
            raise ValueError("not a JSON object")
        return ConfigRecord(parsed)
    except (TypeError, ValueError) as err:
        raise ValueError(f"context.state snapshot layout is malformed: {err}") from None


def journal_bytes(journal: Sequence[tuple[int, bytes]]) -> int:
    """Bytes of the encoded updates in a journal."""
    return sum(len(payload) for _, payload in journal)


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors' data (what a packed snapshot of them holds)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def save_state(
    state: RecordDict,
    client: WorkerState,
    *,
    key: Hashable | None = None,
    snapshot_dir: Path | None = None,
) -> None:
    """Write ``client`` into ``context.state`` (see the module docstring for what is written).

    With ``key`` (the client's run) the live replica is also kept in this process for the
    next message of any client of that run, unless the process holds a newer one. With
    ``snapshot_dir`` a snapshot is written there (:mod:`clients.snapshot_files`) instead of
    into ``context.state``, which then names it.
    """
    save_residuals(state, RESIDUAL_KEY, client.memory.residuals)
    replica = client.replica
    if replica is None:
        return
    chains = list(client.chains)
    saved = client.saved_version
    known = (  # the journal continues the saved history: its digests follow
        saved is not None
        and saved + len(client.journal) == replica.version
        and all(v == saved + 1 + i for i, (v, _) in enumerate(client.journal))
        and 1 <= len(chains) <= len(client.journal) + 1
    )
    steps: dict[int, tuple[str, bytes | None]] = {}  # version -> (digest, update producing it)
    if known:
        for version, payload in client.journal[len(chains) - 1 :]:
            chains.append(extend_chain(chains[-1], version, payload))
        payloads: dict[int, bytes] = dict(client.journal)
        first = replica.version - len(chains) + 1
        steps = {first + i: (c, payloads.get(first + i)) for i, c in enumerate(chains)}
    old_meta = record_of(state, META_KEY, ConfigRecord)
    layout = old_meta.get("layout") if old_meta is not None else None
    file_ref: dict[str, str] = {}
    snapshot = replica.snapshot(copy=False)
    # With snapshot files, a journal over JOURNAL_FOLD_SHARE of a snapshot (fp32 updates) is
    # folded into a file at once instead of riding in context.state with every message.
    small = (snapshot_dir is None
             or journal_bytes(client.journal) <= JOURNAL_FOLD_SHARE * tensor_bytes(snapshot))
    if known and len(client.journal) <= JOURNAL_LIMIT and isinstance(layout, str) and small:
        # the snapshot did not change: nor its file
        assert old_meta is not None
        file_ref = {k: v for k, v in old_meta.items() if k in FILE_KEYS and isinstance(v, str)}
    else:
        blob, packed_layout = pack_tensors(snapshot)
        layout = _layout_text(packed_layout)
        client.saved_version, client.journal = replica.version, []
        # Folding the journal into a snapshot changes neither the replica nor its
        # digest; an unknown history starts from the snapshot's bytes.
        if not known:
            chains = [snapshot_chain(replica.version, array_to_bytes(blob))]
            steps = {replica.version: (chains[0], None)}
        chains = chains[-1:]
        if snapshot_dir is None:
            state[REPLICA_KEY] = ArrayRecord({BLOB_KEY: blob})
        else:
            file_ref = write_snapshot(snapshot_dir, replica.version, chains[0], blob.data)
            if REPLICA_KEY in state:
                del state[REPLICA_KEY]
    saved = client.saved_version
    assert saved is not None
    meta = ConfigRecord(
        {
            "version": replica.version,
            "saved-version": saved,
            "chains": chains,
            "journal": [payload for _, payload in client.journal],
            "layout": layout,
        }
    )
    if client.compressor is not None:
        meta["compressor"] = client.compressor
    meta.update(file_ref)
    state[META_KEY] = meta
    client.chains = chains
    if key is not None:
        _keep(key, replica, steps, client.history if isinstance(client, _Loaded) else {})


def _keep(
    key: Hashable,
    replica: Replica,
    steps: dict[int, tuple[str, bytes | None]],
    inherited: dict[int, tuple[str, bytes | None]],
) -> None:
    """Keep ``replica`` as the run's live replica, unless this process holds a newer replica
    of the same history (the latest saved wins otherwise: it is the likeliest next match).

    ``steps`` is the replica's known history (version -> digest, update producing it),
    ``inherited`` the history of the shared replica it was taken from (kept where the
    digests agree).
    """
    held = _shared.get(key)
    mine = steps[replica.version][0]
    if (
        held is not None
        and held.replica.version > replica.version
        and held.history.get(replica.version, ("", None))[0] == mine
    ):
        return
    first = min(steps)
    history = dict(inherited) if inherited.get(first, ("", None))[0] == steps[first][0] else {}
    for v, (chain, payload) in steps.items():
        history[v] = (chain, payload if payload is not None else history.get(v, ("", None))[1])
    oldest = replica.version - JOURNAL_LIMIT
    kept = {v: h for v, h in history.items() if oldest <= v <= replica.version}
    _shared[key] = _Shared(replica, kept)
    _shared.move_to_end(key)
    while len(_shared) > _RUNS_KEPT:
        _shared.popitem(last=False)
