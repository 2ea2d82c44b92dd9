"""A process shares one live replica among the clients of a run, checked by history digests.

Flower's simulation actors have no client affinity: a client's next message often lands in
another process. Every client of a run holds the same replica at the same version, so a
process keeps one live replica per run and hands it to whichever client's history digest
matches: as it is, caught up with the client's journal, or adopted by a client whose
message brings the updates the replica already applied. The tests check that a run is bit
for bit the run of one process, that the rebuilds and repeated applications are gone, and
that a replica of another history is never handed out.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

import clients.state as client_state
from clients.client_app import make_client_app
from clients.state import cached_replicas, extend_chain, load_state, save_state
from fedddl.app_config import AppConfig
from fedddl.compression import IdentityCompressor, encode_update
from fedddl.compression.codecs.downlink import TAG_ENCODED, decode_broadcast_parts
from fedddl.flower.inline_grid import InlineGrid
from fedddl.replica import Replica
from fedddl.sync.worker import WorkerState
from strategies.server_app import run_server

CFG = AppConfig(num_server_rounds=12, eval_every=12, eval_samples=200)
RUN = "run"


class _Processes:
    """Deliver each message in one of ``n`` simulated processes (one shared slot each)."""

    def __init__(self, n: int, seed: int) -> None:
        self.slots: list[OrderedDict[Any, Any]] = [OrderedDict() for _ in range(n)]
        self.rng = random.Random(seed)

    def before(self, message: Message, context: Context) -> None:
        client_state._shared = self.rng.choice(self.slots)


class _Counts:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.builds = 0  # replicas rebuilt from a client's records
        self.applied = 0  # updates applied by any replica (the server's shadow included)
        counts = self

        class Counting(Replica):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                counts.builds += 1
                super().__init__(*args, **kwargs)

        original = Replica.apply_update

        def apply_update(replica: Replica, *args: Any, **kwargs: Any) -> None:
            counts.applied += 1
            original(replica, *args, **kwargs)

        monkeypatch.setattr(client_state, "Replica", Counting)
        monkeypatch.setattr(Replica, "apply_update", apply_update)


def _run(
    monkeypatch: pytest.MonkeyPatch, processes: _Processes | None
) -> tuple[dict[str, Any], _Counts]:
    counts = _Counts(monkeypatch)
    monkeypatch.setattr(client_state, "_shared", OrderedDict())
    before = None if processes is None else processes.before
    grid = InlineGrid(make_client_app(CFG), 4, before=before)
    return run_server(grid, CFG), counts


def test_a_shared_replica_gives_the_run_of_one_process_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one, one_counts = _run(monkeypatch, None)
    assert one_counts.builds == 0  # one process: always the live replica
    # ... which applies each broadcast update once for all four clients (11 updates
    # reach the clients, 12 the server's shadow); a replica per client applies 4 x 11.
    assert one_counts.applied == 11 + 12, one_counts.applied
    many, many_counts = _run(monkeypatch, _Processes(3, seed=1))
    assert many["final_fingerprint"] == one["final_fingerprint"]
    assert many["final_accuracy"] == one["final_accuracy"]
    assert all(r["replicas_equal"] for r in many["rounds"])
    assert [r["bytes_up"] for r in many["rounds"]] == [r["bytes_up"] for r in one["rounds"]]
    # Three processes: a process rebuilds only when it has no replica of the run yet or
    # its replica is older than the client's snapshot, never every round.
    assert many_counts.builds <= 3, many_counts.builds
    assert many_counts.applied <= 12 + 3 * 11  # each process applies an update at most once
    assert cached_replicas() <= 1


def _update(replica: Replica, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    grads = {
        k: torch.randn(p.shape, generator=gen) for k, p in replica.model.named_parameters()
    }
    return TAG_ENCODED + encode_update(grads, IdentityCompressor())


def _apply(st: WorkerState, payload: bytes) -> None:
    assert st.replica is not None
    update, statistics = decode_broadcast_parts(payload)
    st.replica.apply_update(update, st.replica.version + 1, statistics)
    st.journal.append((st.replica.version, payload))


def _payloads(n: int) -> list[bytes]:
    replica = Replica(CFG.model_factory()(), 0.1, 0.9)
    return [_update(replica, s) for s in range(n)]


def _load(state: RecordDict, **kwargs: Any) -> WorkerState:
    return load_state(state, CFG.model_factory(), 0.1, 0.9, **kwargs)


def _first_save(state: RecordDict, key: Any = RUN) -> WorkerState:
    st = WorkerState(Replica(CFG.model_factory()(), 0.1, 0.9), "ternary-base3")
    save_state(state, st, key=key)
    return st


def _fingerprint(st: WorkerState) -> str:
    assert st.replica is not None
    return st.replica.fingerprint()


def test_catch_up_equals_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    a: OrderedDict[Any, Any] = OrderedDict()
    b: OrderedDict[Any, Any] = OrderedDict()
    payloads = _payloads(3)
    state = RecordDict()
    monkeypatch.setattr(client_state, "_shared", a)
    st = _first_save(state)
    st = _load(state, key=RUN)
    _apply(st, payloads[0])
    save_state(state, st, key=RUN)  # process A keeps version 1
    monkeypatch.setattr(client_state, "_shared", b)
    st_b = _load(state, key=RUN)  # B rebuilds, goes to 3
    _apply(st_b, payloads[1])
    _apply(st_b, payloads[2])
    save_state(state, st_b, key=RUN)
    rebuilt = _load(state)  # no key: a rebuild from the records
    monkeypatch.setattr(client_state, "_shared", a)
    caught = _load(state, key=RUN)
    assert caught.replica is st.replica  # A's live replica, caught up
    assert caught.replica.version == 3 == rebuilt.replica.version  # type: ignore[union-attr]
    assert _fingerprint(caught) == _fingerprint(rebuilt)
    assert caught.journal == rebuilt.journal and caught.saved_version == rebuilt.saved_version
    assert not a  # taken while the handler runs


def test_a_client_adopts_updates_the_shared_replica_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_state, "_shared", OrderedDict())
    counts = _Counts(monkeypatch)
    payloads = _payloads(2)
    first, second = RecordDict(), RecordDict()
    _first_save(first)
    _first_save(second)
    st = _load(first, key=RUN, updates={1: payloads[0]}, target=1)
    _apply(st, payloads[0])
    save_state(first, st, key=RUN)
    before = counts.applied
    other = _load(second, key=RUN, updates={1: payloads[0]}, target=1)
    assert other.replica is not None and other.replica is st.replica
    assert other.replica.version == 1
    assert counts.applied == before  # not applied twice
    assert other.journal == st.journal
    save_state(second, other, key=RUN)
    meta_1, meta_2 = first["fedddl.meta"], second["fedddl.meta"]
    assert isinstance(meta_1, ConfigRecord) and isinstance(meta_2, ConfigRecord)
    assert meta_1["chains"] == meta_2["chains"]
    assert _fingerprint(_load(second)) == _fingerprint(st)  # its records rebuild it
    # A message whose update 2 differs from the one the shared replica applied is not
    # served by it: the client rebuilds and the shared replica stays in the process.
    third = RecordDict()
    _first_save(third)
    st3 = _load(third, key=RUN)  # version 0 -> the shared replica (at 1) is ahead
    assert st3.replica is not st.replica and st3.replica.version == 0  # type: ignore[union-attr]
    held = client_state._shared[RUN].replica
    wrong = _load(second, key=RUN, updates={2: payloads[1]}, target=1)
    assert wrong.replica is held  # same version: used as it is
    save_state(second, wrong, key=RUN)
    mismatched = _load(third, key=RUN, updates={1: payloads[1]}, target=1)
    assert mismatched.replica is not held and client_state._shared[RUN].replica is held


def test_another_history_is_never_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_state, "_shared", OrderedDict())
    payloads = _payloads(3)
    state, other = RecordDict(), RecordDict()
    _first_save(state)
    st = _load(state, key=RUN)
    _apply(st, payloads[0])
    save_state(state, st, key=RUN)  # the shared replica: version 1 of history A
    fresh = WorkerState(Replica(CFG.model_factory()(), 0.1, 0.9), "ternary-base3")
    _apply(fresh, payloads[1])  # version 1 of history B
    fresh.saved_version = None  # a server snapshot: a new history, written in full
    save_state(other, fresh)
    loaded = _load(other, key=RUN)
    assert loaded.replica is not st.replica
    assert _fingerprint(loaded) == _fingerprint(fresh)
    # The same bytes reached by another path (a server snapshot of history A at version
    # 1) get the digest of history A's snapshot, so the two are shared from then on.
    again = WorkerState(Replica(CFG.model_factory()(), 0.1, 0.9, version=0), "ternary-base3")
    assert st.replica is not None and again.replica is not None
    again.replica.load_snapshot(st.replica.snapshot(), 1)
    fresh_state = RecordDict()
    save_state(fresh_state, again)
    copy_state = RecordDict()
    save_state(copy_state, WorkerState(st.replica, "ternary-base3"))
    chains = [s["fedddl.meta"]["chains"] for s in (fresh_state, copy_state)]  # type: ignore[index]
    assert chains[0] == chains[1]
    assert chains[0] != other["fedddl.meta"]["chains"]  # type: ignore[index]


def test_records_without_digests_are_rebuilt_then_digested(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_state, "_shared", OrderedDict())
    payloads = _payloads(2)
    state = RecordDict()
    _first_save(state)
    st = _load(state, key=RUN)
    _apply(st, payloads[0])
    save_state(state, st, key=RUN)
    meta = state["fedddl.meta"]
    assert isinstance(meta, ConfigRecord)
    chains = meta["chains"]
    assert isinstance(chains, list) and len(chains) == 2
    assert chains[1] == extend_chain(str(chains[0]), 1, payloads[0])
    del meta["chains"]  # records of an older release
    old = _load(state, key=RUN)
    assert old.replica is not st.replica  # no digest: nothing to match, rebuilt
    assert _fingerprint(old) == _fingerprint(st)
    save_state(state, old, key=RUN)  # written in full, with a digest again
    meta = state["fedddl.meta"]
    assert isinstance(meta, ConfigRecord) and meta["saved-version"] == 1
    assert isinstance(meta["chains"], list) and len(meta["chains"]) == 1


def test_snapshots_in_files_keep_context_state_small_and_the_run_identical(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    full, _ = _run(monkeypatch, None)
    files = CFG.replace(client_snapshot_dir=str(tmp_path))
    monkeypatch.setattr(client_state, "_shared", OrderedDict())
    grid = InlineGrid(make_client_app(files), 4, before=_Processes(3, seed=1).before)
    counts = _Counts(monkeypatch)
    many = run_server(grid, files)
    # Three processes rebuilding from the files: the run of one process, bit for bit.
    assert many["final_fingerprint"] == full["final_fingerprint"]
    assert [r["bytes_down"] for r in many["rounds"]] == [r["bytes_down"] for r in full["rounds"]]
    assert counts.builds <= 3
    # One file per snapshot version, shared by the four clients (same state, same name).
    names = sorted(p.name for p in tmp_path.glob("*.snap"))
    assert 1 <= len(names) <= 3 and not list(tmp_path.glob("*.tmp")), names
    for context in grid.contexts.values():
        assert "fedddl.replica" not in context.state  # named, not carried
        meta = context.state["fedddl.meta"]
        assert isinstance(meta, ConfigRecord) and meta["snapshot-file"] in names
    # A missing or altered file is no error: no replica (the client asks for a snapshot).
    state = next(iter(grid.contexts.values())).state
    assert _load(state, snapshot_dir=tmp_path).replica is not None
    path = tmp_path / str(state["fedddl.meta"]["snapshot-file"])  # type: ignore[index]
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    assert _load(state, snapshot_dir=tmp_path).replica is None
    path.unlink()
    assert _load(state, snapshot_dir=tmp_path).replica is None


def test_a_round_changes_one_record_and_bad_records_are_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Flower pickles the whole context.state with every message, at a cost per record
    # and per Array: with the snapshot in a file, the state is one ConfigRecord whose
    # journal holds the encoded updates since the snapshot, in order. (The stand-in updates
    # are fp32, as large as the model; a journal of them is kept here as one of ternary
    # updates would be, not folded into a file at once.)
    monkeypatch.setattr(client_state, "_shared", OrderedDict())
    monkeypatch.setattr(client_state, "JOURNAL_FOLD_SHARE", math.inf)
    payloads = _payloads(3)
    state = RecordDict()
    st = WorkerState(Replica(CFG.model_factory()(), 0.1, 0.9), "ternary-base3")
    save_state(state, st, snapshot_dir=tmp_path)
    for payload in payloads:
        _apply(st, payload)
        save_state(state, st, snapshot_dir=tmp_path)
    assert list(state) == ["fedddl.meta"]
    meta = state["fedddl.meta"]
    assert isinstance(meta, ConfigRecord)
    assert meta["version"] == 3 and meta["saved-version"] == 0
    assert meta["journal"] == payloads
    rebuilt = _load(state, snapshot_dir=tmp_path)  # no key: from the file and the journal
    assert rebuilt.replica is not None and rebuilt.replica.version == 3
    assert _fingerprint(rebuilt) == _fingerprint(st)
    # A journal that is not a list of updates, or a layout that is not one, is named
    # (the client answers with that error), never half-loaded.
    for name, value in [
        ("journal", [1, 2, 3]),
        ("journal", b"not a list"),
        ("layout", "[1, 2]"),
        ("layout", "{not json"),
        ("layout", '{"names": [null]}'),
    ]:
        broken = RecordDict({"fedddl.meta": ConfigRecord(dict(meta))})
        broken["fedddl.meta"][name] = value  # type: ignore[index]
        with pytest.raises(ValueError, match=f"context.state (snapshot )?{name}"):
            _load(broken, snapshot_dir=tmp_path)
    # A journal one update short of the version: the replay stops where the journal
    # does, and the digests (which no longer fit) are not trusted.
    short = RecordDict({"fedddl.meta": ConfigRecord(dict(meta))})
    short["fedddl.meta"]["journal"] = payloads[:2]  # type: ignore[index]
    partial = _load(short, snapshot_dir=tmp_path)
    assert partial.replica is not None and partial.replica.version == 2
    assert partial.chains == []
