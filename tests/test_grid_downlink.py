"""The ``grid`` downlink: exact replicas, small catch-ups, limits, malformed messages.

Through the real ServerApp loop and ClientApp on the in-process grid (no Ray), and through
the Flower-free server and worker with every instruction carried by the Flower protocol
(:mod:`fedddl.flower.protocol`) as a transport would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.data import as_tensors, load_dataset
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.protocol import build_train_content, parse_train_content
from fedddl.partition import stratified_shards
from fedddl.sync import ClientReply, ReplicaServer
from fedddl.sync.grid import GridError
from fedddl.sync.grid_replica import CATCH_UP_MAGIC, GridReplica
from fedddl.sync.messages import TrainInstruction
from fedddl.sync.worker import WorkerState, run_instruction
from strategies.server_app import run_server

NODES = tuple(range(10))


def _run(downlink: str) -> dict[str, Any]:
    cfg = AppConfig(
        dataset="digits",
        num_server_rounds=20,
        fraction_train=0.3,
        downlink=downlink,
        min_available_nodes=20,
    )
    grid = InlineGrid(make_client_app(cfg), 20)
    return run_server(grid, cfg, progress=lambda _: None)


def test_grid_downlink_keeps_replicas_exact_with_far_fewer_bytes_down() -> None:
    grid, usual = _run("grid"), _run("reternarize")
    assert all(r["replicas_equal"] for r in grid["rounds"])
    assert all(r["downlink_format"] == "grid" for r in grid["rounds"])
    assert not any(r["skipped"] for r in grid["rounds"])
    down, usual_down = grid["summary"]["mean_bytes_down"], usual["summary"]["mean_bytes_down"]
    assert down < 0.25 * usual_down
    assert grid["summary"]["final_accuracy"] > usual["summary"]["final_accuracy"] - 0.03


class GridCluster:
    """A grid-downlink ReplicaServer and ten in-memory workers on stratified digits shards."""

    def __init__(self, **settings: Any) -> None:
        self.cfg = AppConfig(dataset="digits", downlink="grid", **settings)
        x, y = as_tensors(load_dataset("digits", split="train"))
        shards = stratified_shards(y.numpy(), len(NODES), seed=0)
        self.shards = {n: (x[s], y[s]) for n, s in zip(NODES, shards, strict=True)}
        cfg = self.cfg
        self.server = ReplicaServer(
            cfg.model_factory(),
            learning_rate=cfg.learning_rate,
            momentum=cfg.momentum,
            compressor=cfg.compressor,
            downlink="grid",
            grid_levels=cfg.grid_levels,
            grid_log_size=cfg.grid_log_size,
            defenses=cfg.defenses(),
            fp32_logits=cfg.fp32_logits,
        )
        self.states = {n: WorkerState() for n in NODES}
        self.round = 0

    def plan(self, nodes: tuple[int, ...]) -> dict[int, TrainInstruction]:
        self.round += 1
        plan = self.server.plan_round(self.round, nodes)
        return {n: parse_train_content(build_train_content(i)) for n, i in plan.items()}

    def answer(self, node: int, instruction: TrainInstruction) -> ClientReply:
        return run_instruction(
            self.states[node],
            instruction,
            node_id=node,
            partition_id=node,
            shard=lambda: self.shards[node],
            model_fn=self.cfg.model_factory(),
            cfg=self.cfg,
        )

    def step(self, nodes: tuple[int, ...]) -> None:
        plan = self.plan(nodes)
        report = self.server.aggregate(self.round, [self.answer(n, plan[n]) for n in nodes])
        assert report.accepted == sorted(nodes) and report.replicas_equal


def test_a_client_far_behind_and_one_that_never_trained_catch_up_exactly() -> None:
    cluster = GridCluster()
    for _ in range(3):
        cluster.step((0, 1, 2))
    for _ in range(15):
        cluster.step((1, 2, 3))  # node 0 falls 15 versions behind; node 9 never trains
    plan = cluster.plan((0, 9, 1))
    for node in (0, 9):
        assert plan[node].snapshot is None
        ((version, message),) = plan[node].updates
        assert version == 18 and message[:4] == CATCH_UP_MAGIC
    assert len(plan[0].updates[0][1]) < len(plan[9].updates[0][1]) < 20_000
    replies = [cluster.answer(n, plan[n]) for n in (0, 9, 1)]
    report = cluster.server.aggregate(cluster.round, replies)
    assert report.accepted == [0, 1, 9] and report.replicas_equal
    for node in (0, 9):
        held = cluster.states[node].grid
        assert held is not None and held.version == 18
        assert held.fingerprint() == cluster.server.fingerprints[18]


def test_a_new_client_gets_the_counts_since_the_seed_when_the_log_does_not_reach_back() -> None:
    cluster = GridCluster(grid_log_size=2)
    for _ in range(4):
        cluster.step((0, 1))
    assert cluster.server.log.oldest == 2 and not cluster.server.replica.rebased
    plan = cluster.plan((5, 0))
    assert plan[5].snapshot is None and plan[5].updates[0][1][:4] == CATCH_UP_MAGIC
    report = cluster.server.aggregate(cluster.round, [cluster.answer(n, plan[n]) for n in (5, 0)])
    assert report.accepted == [0, 5] and report.replicas_equal


def test_a_client_claiming_an_old_version_gets_at_most_a_count_delta_and_is_limited() -> None:
    cluster = GridCluster()
    for _ in range(6):
        cluster.step((0, 1))
    # node 0 lies: it claims version 1 (it holds 6)
    plan = cluster.plan((0, 1))
    lie = ClientReply.resync_request(0, 1)
    cluster.server.aggregate(cluster.round, [lie, cluster.answer(1, plan[1])])
    plan = cluster.plan((0, 1))
    assert plan[0].snapshot is None and len(plan[0].updates) == 1  # one count delta from 1
    cluster.server.aggregate(cluster.round, [lie, cluster.answer(1, plan[1])])
    plan = cluster.plan((0, 1))  # the repeat is held back: the usual one-version catch-up
    assert cluster.server.planner.take_limited() == [0]
    assert plan[0].snapshot is None and plan[0].updates == plan[1].updates
    # a claim of no state at all gets a snapshot, never more
    assert cluster.server.replica.catch_up(-1).kind == "snapshot"


def test_malformed_count_delta_bytes_are_refused_and_change_nothing() -> None:
    cluster = GridCluster()
    cluster.step((0, 1))
    cluster.step((1,))
    plan = cluster.plan((0,))
    ((version, message),) = plan[0].updates
    held = cluster.states[0].grid
    assert held is not None and held.version == 0 and version == 2
    before = (held.fingerprint(), held.grid.copy())
    corrupt = [
        message[:-5] + bytes([message[-5] ^ 1]) + message[-4:],  # CRC
        message[: len(message) // 2],  # truncated
        b"XXXX" + message[4:],  # magic
    ]
    for data in corrupt:
        bad = dataclasses.replace(plan[0], updates=[(version, data)])
        with pytest.raises(GridError, match="grid catch-up"):
            cluster.answer(0, bad)
        assert held.version == 0 and held.fingerprint() == before[0]
        assert all(
            torch.equal(held.grid.tensors[n].counts, t.counts) for n, t in before[1].tensors.items()
        )
    reply = cluster.answer(0, plan[0])  # the genuine message still applies
    assert reply.model_version == 2 and not reply.resync


def test_grid_snapshot_round_trips_bit_for_bit() -> None:
    cluster = GridCluster()
    for _ in range(3):
        cluster.step((0, 1))
    shadow = cluster.server.replica.replica
    assert isinstance(shadow, GridReplica)
    copy = GridReplica(cluster.cfg.model_factory()())
    copy.load_snapshot_bytes(shadow.snapshot_bytes())
    assert copy.version == 3 and copy.fingerprint() == shadow.fingerprint()
    with pytest.raises(GridError, match="grid snapshot"):
        copy.load_snapshot_bytes(shadow.snapshot_bytes()[:-3])
    assert copy.fingerprint() == shadow.fingerprint()


def test_grid_settings_are_checked() -> None:
    # checkpoints work with the grid (tests/test_grid_checkpoint.py)
    assert AppConfig(downlink="grid", checkpoint_every=1, checkpoint_dir="/tmp/x").checkpoint_every
    with pytest.raises(ValueError, match="grid-levels"):
        AppConfig(grid_levels=0)
    with pytest.raises(ValueError, match="grid-log-size"):
        AppConfig(grid_log_size=0)


def test_batchnorm_buffers_travel_with_the_catch_up_and_match_the_server() -> None:
    cluster = GridCluster(arch="resnet8", learning_rate=0.05)
    for _ in range(3):
        cluster.step((0, 1))
    shadow = cluster.server.replica.replica
    assert shadow.batchnorm and cluster.server.reports[-1].replicas_equal
    moved = {k: b for k, b in shadow.model.named_buffers() if k.endswith("running_mean")}
    assert any(bool(b.abs().sum() > 0) for b in moved.values())
    plan = cluster.plan((5,))
    reply = cluster.answer(5, plan[5])
    assert reply.model_version == 3 and reply.fingerprint == cluster.server.fingerprints[3][:32]
