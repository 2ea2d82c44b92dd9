"""ClientApp: message parsing, state persistence, resync answers, FedAvg messages, config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from clients.client_app import make_client_app
from clients.shard import load_shard, partition_of
from clients.state import load_state, save_state
from fedddl.app_config import AppConfig
from fedddl.compression import ResidualMemory
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.protocol import build_train_content, parse_reply, parse_train_content
from fedddl.replica import Replica
from fedddl.sync import ReplyError, TrainInstruction
from fedddl.sync.worker import WorkerState

CFG = AppConfig()


def _deliver(
    content: RecordDict, state: RecordDict | None = None, pid: int = 0
) -> tuple[Message, Context]:
    grid = InlineGrid(make_client_app(CFG), 2)
    ctx = grid.contexts[1000 + pid]
    if state is not None:
        ctx.state = state
    msg = Message(content=content, message_type=MessageType.TRAIN, dst_node_id=1000 + pid)
    (reply,) = grid.send_and_receive([msg])
    return reply, ctx


def test_first_message_builds_the_seeded_replica_and_replies_a_gradient() -> None:
    content = build_train_content(TrainInstruction(1, 0, [], compressor="ternary-base3"))
    reply, ctx = _deliver(content)
    parsed = parse_reply(reply)
    assert parsed.model_version == 0 and not parsed.resync
    assert parsed.num_examples == CFG.batch_size
    st = load_state(ctx.state, CFG.model_factory(), CFG.learning_rate, CFG.momentum)
    assert st.replica is not None and st.compressor == "ternary-base3"
    seeded = Replica(CFG.model_factory()(), 0.1, 0.9)
    assert st.replica.fingerprint() == seeded.fingerprint()
    assert parsed.fingerprint == bytes.fromhex(seeded.fingerprint())[:16].hex()


def test_client_without_state_far_behind_asks_for_resync() -> None:
    content = build_train_content(
        TrainInstruction(7, 6, [(6, b"E-not-used")], compressor="ternary")
    )
    reply, ctx = _deliver(content)
    parsed = parse_reply(reply)
    assert parsed.resync and parsed.model_version == -1
    assert "fedddl.replica" not in ctx.state.array_records


def test_client_with_gap_in_updates_reports_its_version() -> None:
    model = CFG.model_factory()()
    replica = Replica(model, 0.1, 0.9, version=0)
    state = RecordDict()
    save_state(state, WorkerState(replica, "ternary"))
    content = build_train_content(TrainInstruction(5, 4, [(3, b"x"), (4, b"y")]))
    reply, _ = _deliver(content, state=state)
    parsed = parse_reply(reply)
    assert parsed.resync and parsed.model_version == 0


def test_corrupted_broadcast_leaves_the_replica_at_its_version() -> None:
    content = build_train_content(
        TrainInstruction(2, 1, [(1, b"E" + b"\x00" * 40)], compressor="ternary")
    )
    reply, ctx = _deliver(content)
    parsed = parse_reply(reply)
    assert parsed.resync and parsed.model_version == 0
    st = load_state(ctx.state, CFG.model_factory(), 0.1, 0.9)
    assert st.replica is not None and st.replica.version == 0


def test_state_round_trip_keeps_weights_momentum_and_residuals() -> None:
    replica = Replica(CFG.model_factory()(), 0.1, 0.9)
    grads = {k: torch.randn(p.shape) for k, p in replica.model.named_parameters()}
    replica.apply_update(grads, 1)
    state = RecordDict()
    residuals = {"1.weight": torch.randn(64, 64)}
    key = ("run", 7)
    save_state(state, WorkerState(replica, "ternary", ResidualMemory(residuals)), key=key)
    back = load_state(state, CFG.model_factory(), 0.1, 0.9)
    assert back.replica is not None and back.replica.version == 1
    assert back.replica is not replica  # really deserialized
    assert back.replica.fingerprint() == replica.fingerprint()
    assert torch.equal(back.memory.residuals["1.weight"], residuals["1.weight"])
    cached = load_state(state, CFG.model_factory(), 0.1, 0.9, key=key)
    assert cached.replica is replica  # the live object, taken out of the cache once
    again = load_state(state, CFG.model_factory(), 0.1, 0.9, key=key)
    assert again.replica is not replica and again.replica is not None
    assert again.replica.fingerprint() == replica.fingerprint()
    replica = again.replica
    replica.apply_update(grads, 2)
    back.replica.apply_update(grads, 2)
    assert back.replica is not replica
    assert back.replica.fingerprint() == replica.fingerprint()  # momentum restored too


def test_fedavg_message_trains_and_returns_weights() -> None:
    model = CFG.model_factory()()
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord({"server-round": 1})}
    )
    reply, _ = _deliver(content)
    assert not reply.has_error()
    new = reply.content["arrays"].to_torch_state_dict()  # type: ignore[union-attr]
    assert set(new) == set(model.state_dict())
    assert any(not torch.equal(new[k], v) for k, v in model.state_dict().items())
    assert reply.content["metrics"]["num-examples"] == CFG.batch_size * CFG.local_steps  # type: ignore[index]


def test_unknown_message_gives_an_error_reply() -> None:
    reply, _ = _deliver(RecordDict({"config": ConfigRecord({"server-round": 1})}))
    assert reply.has_error() and "neither" in (reply.error.reason or "")


def test_parse_train_content_rejects_missing_config() -> None:
    with pytest.raises(ReplyError, match="no 'config'"):
        parse_train_content(RecordDict())
    with pytest.raises(ReplyError, match="'model-version' must be an int"):
        parse_train_content(RecordDict({"config": ConfigRecord({"server-round": 1})}))


def test_train_content_round_trip() -> None:
    instr = TrainInstruction(
        3,
        2,
        [(2, b"bb"), (1, b"a")],
        compressor="ternary",
        scales=torch.tensor([0.5, 2.0]),
        want_scales=True,
    )
    back = parse_train_content(build_train_content(instr))
    assert back.updates == [(1, b"a"), (2, b"bb")]
    assert back.compressor == "ternary" and back.want_scales and back.snapshot is None
    assert back.scales is not None and back.scales.tolist() == [0.5, 2.0]


def test_partition_of_and_shards_cover_the_training_split() -> None:
    assert partition_of({"partition-id": 2, "num-partitions": 5}) == (2, 5)
    with pytest.raises(ValueError, match="partition-id"):
        partition_of({"num-partitions": 5})
    with pytest.raises(ValueError, match="not in"):
        partition_of({"partition-id": 5, "num-partitions": 5})
    sizes = [load_shard(CFG, i, 4)[0].shape[0] for i in range(4)]
    from fedddl.data import load_dataset

    assert sum(sizes) == len(load_dataset("digits", split="train"))  # type: ignore[arg-type]
    assert max(sizes) - min(sizes) <= 4


def test_app_config_parses_run_config_and_names_bad_keys() -> None:
    cfg = AppConfig.from_run_config(
        {
            "num-server-rounds": 7,
            "learning-rate": 1,
            "error-feedback": "true",
            "downlink": "shared-scale-sum",
        }
    )
    assert cfg.num_server_rounds == 7 and cfg.learning_rate == 1.0 and cfg.error_feedback
    assert AppConfig.from_run_config(cfg.to_run_config()) == cfg
    with pytest.raises(ValueError, match="unknown config key 'lr'"):
        AppConfig.from_run_config({"lr": 0.1})
    with pytest.raises(ValueError, match="'batch-size' must be an integer"):
        AppConfig.from_run_config({"batch-size": "big"})
    with pytest.raises(ValueError, match="downlink must be one of"):
        AppConfig(downlink="zip")
    with pytest.raises(ValueError, match="fraction-train"):
        AppConfig(fraction_train=0.0)
    with pytest.raises(ValueError, match="strategy must be"):
        AppConfig(strategy="fedsgd")
    with pytest.raises(ValueError, match=r"client-snapshot-dir.*absolute"):
        AppConfig(client_snapshot_dir="snapshots")
    assert AppConfig(client_snapshot_dir="/tmp/snapshots").client_snapshot_dir == "/tmp/snapshots"


def test_pyproject_app_config_is_valid() -> None:
    from pathlib import Path

    import tomllib

    data = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    cfg = AppConfig.from_run_config(data["tool"]["flwr"]["app"]["config"])
    assert cfg.strategy == "terngrad" and cfg.dataset == "digits"


def test_pack_tensors_round_trip_and_bad_layouts() -> None:
    from fedddl.flower.records import bytes_to_array, pack_tensors, unpack_tensors

    tensors = {
        "w": torch.randn(3, 4),
        "n": torch.tensor(7),
        "h": torch.randn(5).to(torch.bfloat16),
        "e": torch.zeros(0, 2),
    }
    blob, layout = pack_tensors(tensors)
    back = unpack_tensors(blob, layout)
    assert list(back) == list(tensors)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    with pytest.raises(ValueError, match="every byte"):
        unpack_tensors(bytes_to_array(bytes(blob.data) + b"\0"), layout)
    with pytest.raises(ValueError, match="runs past"):
        unpack_tensors(bytes_to_array(bytes(blob.data)[:-4]), layout)
    bad = ConfigRecord(dict(layout, dtypes=["float32", "nope", "bfloat16", "float32"]))
    with pytest.raises(ValueError, match="bad dtype"):
        unpack_tensors(blob, bad)


def test_a_bound_app_pickles_as_its_config_and_loads_once_per_process() -> None:
    """Flower's Ray simulation pickles the ClientApp with every message: a bound app travels
    as its config and the receiving process reuses the app it built for that config."""
    import pickle

    from clients.client_app import app as unbound

    cfg = AppConfig(strategy="terngrad", seed=7)
    bound = make_client_app(cfg)
    data = pickle.dumps(bound)
    first, second = pickle.loads(data), pickle.loads(pickle.dumps(bound))
    assert first is second and first.fedddl_config == cfg  # type: ignore[attr-defined]
    assert b"handle_train" not in data  # the handler closures do not travel
    other = pickle.loads(pickle.dumps(make_client_app(AppConfig(strategy="terngrad", seed=8))))
    assert other is not first and other.fedddl_config.seed == 8  # type: ignore[attr-defined]
    # it answers a message as the app it was pickled from does
    content = build_train_content(TrainInstruction(1, 0, [], compressor="ternary-base3"))
    replies = []
    for client_app in (bound, first):
        grid = InlineGrid(client_app, 1)
        msg = Message(content=content, message_type=MessageType.TRAIN, dst_node_id=1000)
        (reply,) = grid.send_and_receive([msg])
        replies.append(parse_reply(reply))
    assert replies[0].payload == replies[1].payload and replies[0].loss == replies[1].loss
    assert not hasattr(unbound, "fedddl_config")  # flwr run's app reads run_config


def test_a_reply_reports_its_partition_and_a_bad_one_is_refused() -> None:
    """The server combines replies in the order of the partitions the clients report."""
    from flwr.app import MetricRecord

    from fedddl.flower.protocol import MAX_PARTITION_ID, METRICS, PARTITION_ID

    content = build_train_content(TrainInstruction(1, 0, [], compressor="ternary-base3"))
    reply, _ = _deliver(content, pid=1)
    assert parse_reply(reply).partition_id == 1
    for bad in (-1, MAX_PARTITION_ID + 1, 1.5):
        metrics = reply.content[METRICS]
        assert isinstance(metrics, MetricRecord)
        metrics[PARTITION_ID] = bad
        with pytest.raises(ReplyError, match="'partition-id' must be"):
            parse_reply(reply)
    del reply.content[METRICS][PARTITION_ID]  # type: ignore[attr-defined]
    assert parse_reply(reply).partition_id is None  # not reported: combined after the others


@pytest.mark.parametrize(("payload_bytes", "folded"), [(64, False), (None, True)])
def test_a_journal_larger_than_half_a_snapshot_is_folded_into_a_file(
        payload_bytes: int | None, folded: bool, tmp_path: Path) -> None:
    """With snapshot files, small (ternary) updates are journaled; an update as large as half
    the replica's snapshot (fp32) makes save_state write a snapshot file instead, so
    context.state never carries model-sized updates."""
    from clients.state import journal_bytes, tensor_bytes

    replica = Replica(CFG.model_factory()(), 0.1, 0.9, version=0)
    state = RecordDict()
    worker = WorkerState(replica, "ternary")
    save_state(state, worker, snapshot_dir=tmp_path)
    assert worker.saved_version == 0 and len(worker.chains) == 1
    grads = {k: torch.zeros(p.shape) for k, p in replica.model.named_parameters()}
    replica.apply_update(grads, 1)
    size = tensor_bytes(replica.snapshot(copy=False))  # weights and momentum now
    payload = b"u" * (payload_bytes if payload_bytes is not None else size // 2 + 1)
    worker.journal = [(1, payload)]
    assert (2 * journal_bytes(worker.journal) > tensor_bytes(replica.snapshot(copy=False))) \
        == folded
    save_state(state, worker, snapshot_dir=tmp_path)
    assert len(list(tmp_path.glob("*.snap"))) == (2 if folded else 1)
    meta = state["fedddl.meta"]
    assert isinstance(meta, ConfigRecord)
    assert meta["version"] == 1
    assert meta["saved-version"] == (1 if folded else 0)
    assert len(meta["journal"]) == (0 if folded else 1)  # type: ignore[arg-type]
    if folded:  # the snapshot alone restores version 1 (the stand-in payload is no update)
        back = load_state(state, CFG.model_factory(), 0.1, 0.9, snapshot_dir=tmp_path)
        assert back.replica is not None and back.replica.version == 1
        assert back.replica.fingerprint() == replica.fingerprint()
