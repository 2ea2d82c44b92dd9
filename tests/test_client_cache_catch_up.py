"""A client's cached replica, stale because another process served the client, is caught up.

Flower's simulation actors have no client affinity: a client's next message often lands in
another process, whose cached replica is a few versions old. ``load_state`` then applies
the journaled updates to it instead of rebuilding from the snapshot; the tests check that
the run is bit for bit the run of one process and that the rebuilds are (nearly) gone.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import pytest
import torch
from flwr.app import Context, Message, RecordDict

import clients.state as client_state
from clients.client_app import make_client_app
from clients.state import load_state, save_state
from fedddl.app_config import AppConfig
from fedddl.compression import IdentityCompressor, encode_update
from fedddl.compression.downlink import TAG_ENCODED
from fedddl.replica import Replica
from fedddl.sync.worker import WorkerState
from strategies.server_app import run_server
from tests.support.inline_grid import InlineGrid

CFG = AppConfig(num_server_rounds=12, eval_every=12, eval_samples=200)


class _Processes:
    """Deliver each message in one of ``n`` simulated processes (one client cache each)."""

    def __init__(self, n: int, seed: int) -> None:
        self.caches: list[OrderedDict[Any, Any]] = [OrderedDict() for _ in range(n)]
        self.rng = random.Random(seed)

    def before(self, message: Message, context: Context) -> None:
        client_state._live = self.rng.choice(self.caches)


def _run(
    monkeypatch: pytest.MonkeyPatch, processes: _Processes | None
) -> tuple[dict[str, Any], int]:
    builds = [0]
    original = client_state.Replica

    class Counting(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            builds[0] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(client_state, "Replica", Counting)
    monkeypatch.setattr(client_state, "_live", OrderedDict())
    before = None if processes is None else processes.before
    grid = InlineGrid(make_client_app(CFG), 4, before=before)
    return run_server(grid, CFG), builds[0]


def test_stale_caches_are_caught_up_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    one, one_builds = _run(monkeypatch, None)
    many, many_builds = _run(monkeypatch, _Processes(3, seed=1))
    assert many["final_fingerprint"] == one["final_fingerprint"]
    assert many["final_accuracy"] == one["final_accuracy"]
    assert all(r["replicas_equal"] for r in many["rounds"])
    assert [r["bytes_up"] for r in many["rounds"]] == [r["bytes_up"] for r in one["rounds"]]
    assert one_builds == 0  # one process: always the live replica (reach_version builds it)
    # Three processes: a client is rebuilt only when no process has a replica of it within
    # the journal (at most one rebuild per client and process: 4 x 3), never every round.
    assert many_builds <= 12


def _update(replica: Replica, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    grads = {
        k: torch.randn(p.shape, generator=gen) for k, p in replica.model.named_parameters()
    }
    return TAG_ENCODED + encode_update(grads, IdentityCompressor())


def _apply(st: WorkerState, payload: bytes) -> None:
    from fedddl.compression.downlink import decode_broadcast_parts

    assert st.replica is not None
    update, statistics = decode_broadcast_parts(payload)
    st.replica.apply_update(update, st.replica.version + 1, statistics)
    st.journal.append((st.replica.version, payload))


def test_catch_up_equals_rebuild_and_a_new_lineage_is_not_caught_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_fn = CFG.model_factory()
    a: OrderedDict[Any, Any] = OrderedDict()
    b: OrderedDict[Any, Any] = OrderedDict()
    key = ("run", 1)
    state = RecordDict()
    monkeypatch.setattr(client_state, "_live", a)
    st = WorkerState(Replica(model_fn(), 0.1, 0.9), "ternary-base3")
    payloads = [_update(st.replica, s) for s in range(4)]  # type: ignore[arg-type]
    _apply(st, payloads[0])
    save_state(state, st, key=key)  # process A caches version 1
    monkeypatch.setattr(client_state, "_live", b)
    st_b = load_state(state, model_fn, 0.1, 0.9, key=key)  # B rebuilds, goes to 3
    _apply(st_b, payloads[1])
    _apply(st_b, payloads[2])
    save_state(state, st_b, key=key)
    rebuilt = load_state(state, model_fn, 0.1, 0.9)  # no key: a rebuild from the records
    monkeypatch.setattr(client_state, "_live", a)
    caught = load_state(state, model_fn, 0.1, 0.9, key=key)
    assert caught.replica is st.replica  # A's live replica, caught up
    assert caught.replica.version == 3 == rebuilt.replica.version  # type: ignore[union-attr]
    assert caught.replica.fingerprint() == rebuilt.replica.fingerprint()  # type: ignore[union-attr]
    assert caught.journal == rebuilt.journal and caught.saved_version == rebuilt.saved_version

    # A server snapshot starts a new lineage: A's old replica must not be caught up to it.
    save_state(state, caught, key=key)  # A caches version 3
    monkeypatch.setattr(client_state, "_live", b)
    fresh = WorkerState(Replica(model_fn(), 0.1, 0.9, version=0), "ternary-base3")
    fresh.replica.load_snapshot(rebuilt.replica.snapshot(), 2)  # type: ignore[union-attr]
    _apply(fresh, payloads[3])  # version 3 again, from another lineage
    _apply(fresh, payloads[3])
    save_state(state, fresh, key=key)
    monkeypatch.setattr(client_state, "_live", a)
    back = load_state(state, model_fn, 0.1, 0.9, key=key)
    assert back.replica is not caught.replica
    assert back.replica.fingerprint() == fresh.replica.fingerprint()  # type: ignore[union-attr]
