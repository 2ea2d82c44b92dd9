"""Replica versioning, update log, catch-up planning: replay and snapshot agree bit for bit."""

from __future__ import annotations

import pytest
import torch

from fedddl.models import create_model
from fedddl.replica import Replica, ReplicaError, UpdateLog, check_update, plan_catch_up


def _replica(version: int = 0) -> Replica:
    return Replica(create_model("digits", seed=0), 0.1, 0.9, version=version)


def _updates(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    model = create_model("digits", seed=0)
    return [
        {k: torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
        for _ in range(n)
    ]


def test_same_updates_give_identical_fingerprints_and_differ_from_start() -> None:
    a, b = _replica(), _replica()
    start = a.fingerprint()
    for v, u in enumerate(_updates(3), start=1):
        a.apply_update(u, v)
        b.apply_update(u, v)
    assert a.version == b.version == 3
    assert a.fingerprint() == b.fingerprint() != start


def test_replay_and_snapshot_give_the_same_fingerprint_and_future() -> None:
    ups = _updates(6)
    leader = _replica()
    for v, u in enumerate(ups[:4], start=1):
        leader.apply_update(u, v)
    snap = leader.snapshot()
    assert any(k.startswith("momentum/") for k in snap)  # momentum travels too
    follower = _replica()
    follower.load_snapshot(snap, leader.version)
    replayer = _replica()
    for v, u in enumerate(ups[:4], start=1):
        replayer.apply_update(u, v)
    assert follower.fingerprint() == replayer.fingerprint() == leader.fingerprint()
    # The momentum buffers came along: the next updates keep them identical.
    for v, u in enumerate(ups[4:], start=5):
        for r in (leader, follower, replayer):
            r.apply_update(u, v)
    assert follower.fingerprint() == replayer.fingerprint() == leader.fingerprint()


def test_snapshot_without_momentum_would_diverge() -> None:
    """Guards the test above: dropping momentum buffers changes the trajectory."""
    ups = _updates(3)
    leader = _replica()
    for v, u in enumerate(ups[:2], start=1):
        leader.apply_update(u, v)
    weights_only = {k: t for k, t in leader.snapshot().items() if k.startswith("model/")}
    follower = _replica()
    follower.load_snapshot(weights_only, 2)
    assert follower.fingerprint() == leader.fingerprint()
    leader.apply_update(ups[2], 3)
    follower.apply_update(ups[2], 3)
    assert follower.fingerprint() != leader.fingerprint()


def test_bad_updates_raise_and_leave_the_replica_unchanged() -> None:
    r = _replica()
    fp = r.fingerprint()
    good = _updates(1)[0]
    with pytest.raises(ReplicaError, match="version 2"):
        r.apply_update(good, 2)
    missing = dict(good)
    missing.pop("1.bias")
    with pytest.raises(ReplicaError, match=r"missing \['1.bias'\]"):
        r.apply_update(missing, 1)
    wrong_shape = dict(good, **{"1.bias": torch.zeros(3)})
    with pytest.raises(ReplicaError, match="shape"):
        r.apply_update(wrong_shape, 1)
    nan = dict(good, **{"3.weight": torch.full_like(good["3.weight"], float("nan"))})
    with pytest.raises(ReplicaError, match="non-finite"):
        r.apply_update(nan, 1)
    assert r.fingerprint() == fp and r.version == 0


def test_check_update_rejects_integer_tensors() -> None:
    model = create_model("digits", seed=0)
    ints = {k: torch.zeros(p.shape, dtype=torch.int64) for k, p in model.named_parameters()}
    with pytest.raises(ReplicaError, match="floating-point"):
        check_update(model, ints)


def test_load_snapshot_rejects_mismatched_entries_without_change() -> None:
    r = _replica()
    fp = r.fingerprint()
    snap = _replica().snapshot()
    snap.pop("model/1.weight")
    with pytest.raises(ReplicaError, match="missing"):
        r.load_snapshot(snap, 3)
    snap = _replica().snapshot()
    snap["model/1.weight"] = torch.zeros(2, 2)
    with pytest.raises(ReplicaError, match="shape"):
        r.load_snapshot(snap, 3)
    assert r.fingerprint() == fp and r.version == 0


def test_update_log_is_bounded_and_contiguous() -> None:
    log = UpdateLog(3)
    for v in range(1, 6):
        log.append(v, bytes([v]))
    assert len(log) == 3 and log.oldest() == 3
    assert [v for v, _ in log.since(3)] == [4, 5]
    with pytest.raises(ValueError, match="cannot append 7"):
        log.append(7, b"x")


@pytest.mark.parametrize(
    ("replica_version", "kind", "versions"),
    [
        (5, "none", []),
        (4, "log", [5]),
        (2, "log", [3, 4, 5]),
        (1, "snapshot", []),
        (-1, "snapshot", []),
        (9, "snapshot", []),
    ],
)
def test_plan_catch_up(replica_version: int, kind: str, versions: list[int]) -> None:
    log = UpdateLog(3)
    for v in range(1, 6):
        log.append(v, bytes([v]))
    plan = plan_catch_up(replica_version, 5, log)
    assert plan.kind == kind
    assert [v for v, _ in plan.updates] == versions


def test_plan_catch_up_with_empty_log_needs_snapshot() -> None:
    assert plan_catch_up(0, 1, UpdateLog(0)).kind == "snapshot"
    assert plan_catch_up(0, 0, UpdateLog(0)).kind == "none"


def test_plan_catch_up_snapshot_when_client_is_ahead_of_the_server() -> None:
    """After the server resumes from a checkpoint older than its crash, a client can
    hold versions the server no longer has (or will recompute differently): no replay
    can undo updates, so it must get a snapshot, also when the log covers its version."""
    log = UpdateLog(8)
    for v in range(1, 4):
        log.append(v, bytes([v]))
    for ahead in (4, 5, 100):
        plan = plan_catch_up(ahead, 3, log)
        assert plan.kind == "snapshot" and plan.updates == []
    assert plan_catch_up(2, 3, log).kind == "log"  # control: behind by one replays


def _resync_costs(missed: tuple[int, ...]) -> tuple[int, list[tuple[int, str, int, int | None]]]:
    """Train the digits MLP (ternary-base3, log size 8) for ``max(missed) + 1`` rounds and
    return the serialized bytes of the catch-up message for each number of missed rounds.

    Returns ``(update payload bytes of the last round, [(missed, plan kind, bytes of the
    message the server sends, bytes of a log replay or None when the log does not reach)])``;
    the snapshot alternative is the same message with the snapshot instead of the updates.
    """
    from flwr.app import ArrayRecord

    from clients.client_app import make_client_app
    from fedddl.app_config import AppConfig
    from fedddl.flower.inline_grid import InlineGrid
    from fedddl.flower.protocol import build_train_content
    from fedddl.flower.records import content_nbytes
    from fedddl.sync import TrainInstruction
    from strategies.registry import build_strategy
    from strategies.terngrad import TernGrad

    rounds = max(missed) + 1
    cfg = AppConfig(num_server_rounds=rounds, compressor="ternary-base3", update_log_size=8)
    strategy = build_strategy(cfg, cfg.model_factory())
    assert isinstance(strategy, TernGrad)
    strategy.start(
        grid=InlineGrid(make_client_app(cfg), 2), initial_arrays=ArrayRecord(), num_rounds=rounds
    )
    current = strategy.server.shadow.version
    snapshot_bytes = content_nbytes(
        build_train_content(
            TrainInstruction(rounds + 1, current, [], strategy.server.shadow.snapshot(), current)
        )
    )
    rows: list[tuple[int, str, int, int | None]] = []
    for k in missed:
        plan = plan_catch_up(current - k, current, strategy.server.log)
        replay = None
        if plan.kind == "log":
            replay = content_nbytes(
                build_train_content(TrainInstruction(rounds + 1, current, plan.updates))
            )
        rows.append((k, plan.kind, snapshot_bytes, replay))
    return len(strategy.server.log.since(current - 1)[0][1]), rows


def test_resync_cost_replay_vs_snapshot_table() -> None:
    """Bytes to bring back a client that missed k rounds (run ``pytest -s`` for the table)."""
    update_bytes, rows = _resync_costs((1, 2, 4, 8, 16))
    print(f"\nresync cost, digits MLP, ternary-base3, update-log-size 8 "
          f"(one encoded update: {update_bytes} B)")
    print(f"{'missed':>6} {'plan':>8} {'replay B':>9} {'snapshot B':>10} {'ratio':>6}")
    for k, kind, snap, replay in rows:
        ratio = f"{snap / replay:6.1f}" if replay else "     -"
        print(f"{k:>6} {kind:>8} {replay if replay else '-':>9} {snap:>10} {ratio}")
    kinds = {k: kind for k, kind, _, _ in rows}
    assert kinds == {1: "log", 2: "log", 4: "log", 8: "log", 16: "snapshot"}
    replays = {k: r for k, _, _, r in rows if r is not None}
    snapshot = rows[0][2]
    # Replay grows about linearly with the rounds missed and stays far below a snapshot
    # (fp32 weights + momentum) for this model at the default log size.
    assert replays[1] < replays[2] < replays[4] < replays[8] < snapshot
    assert 3.0 < replays[4] / replays[1] < 5.0
    assert 6.0 < replays[8] / replays[1] < 10.0
