"""The Flower-free localized-replica protocol: ReplicaServer, the worker, NodeBook, aggregation.

No Flower anywhere: the server's instructions go straight to ``run_instruction`` and its
replies straight back, as a transport would carry them.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib

import pytest
import torch

from fedddl.app_config import AppConfig
from fedddl.compression import OpenedMessage, decode_update, encode_update, get_compressor
from fedddl.compression.codecs.downlink import (
    TAG_BUNDLE,
    TAG_ENCODED,
    decode_broadcast,
    decode_broadcast_parts,
)
from fedddl.compression.codecs.wire import read_header
from fedddl.data import as_tensors, load_dataset
from fedddl.partition import stratified_shards
from fedddl.sync import (
    ClientReply,
    Contribution,
    FingerprintMismatch,
    ParseFailure,
    ReplicaServer,
    ReplyError,
    ResyncRequest,
    UnexpectedReply,
    VersionMismatch,
    running_mean,
)
from fedddl.sync import admission as admission_module
from fedddl.sync.nodes import NodeBook
from fedddl.sync.worker import WorkerState, run_instruction

NODES = (11, 12, 13, 14)


class Cluster:
    """A ReplicaServer and four in-memory workers on stratified digits shards."""

    def __init__(self, **settings: object) -> None:
        self.cfg = AppConfig(**settings)  # type: ignore[arg-type]
        x, y = as_tensors(load_dataset("digits", split="train"))
        shards = stratified_shards(y.numpy(), len(NODES), seed=0)
        self.shards = {n: (x[s], y[s]) for n, s in zip(NODES, shards, strict=True)}
        self.server = ReplicaServer(
            self.cfg.model_factory(),
            learning_rate=self.cfg.learning_rate,
            momentum=self.cfg.momentum,
            compressor=self.cfg.compressor,
            downlink=self.cfg.resolved_downlink,
            update_log_size=self.cfg.update_log_size,
            min_replies=self.cfg.min_replies,
            defenses=self.cfg.defenses(),
            fp32_min_numel=self.cfg.fp32_min_numel,
            fp32_logits=self.cfg.fp32_logits,
            fp32_warmup_rounds=self.cfg.fp32_warmup_rounds,
            scale_bucket=self.cfg.scale_bucket,
        )
        self.states = {n: WorkerState() for n in NODES}
        self.round = 0

    def replies(self, nodes: tuple[int, ...] = NODES) -> list[ClientReply]:
        self.round += 1
        plan = self.server.plan_round(self.round, nodes)
        return [
            run_instruction(
                self.states[n],
                plan[n],
                node_id=n,
                partition_id=NODES.index(n),
                shard=lambda n=n: self.shards[n],  # type: ignore[misc]
                model_fn=self.cfg.model_factory(),
                cfg=self.cfg,
            )
            for n in nodes
        ]

    def step(self, nodes: tuple[int, ...] = NODES) -> None:
        self.server.aggregate(self.round + 1, self.replies(nodes))


def test_workers_and_shadow_stay_bit_identical_and_learn() -> None:
    cluster = Cluster(compressor="ternary-base3")
    for _ in range(6):
        cluster.step()
    shadow = cluster.server.shadow
    assert shadow.version == 6
    cluster.replies()  # the next instruction brings every worker to version 6
    for state in cluster.states.values():
        assert state.replica is not None and state.replica.fingerprint() == shadow.fingerprint()
    assert all(r.replicas_equal and len(r.accepted) == len(NODES) for r in cluster.server.reports)
    assert cluster.server.reports[-1].loss < cluster.server.reports[0].loss


def test_the_arrival_order_of_the_replies_does_not_change_the_model() -> None:
    forward, backward = Cluster(), Cluster()  # fp32 logits: float sums depend on their order
    for _ in range(3):
        forward.server.aggregate(forward.round + 1, forward.replies())
        backward.server.aggregate(backward.round + 1, backward.replies()[::-1])
    assert forward.server.shadow.fingerprint() == backward.server.shadow.fingerprint()
    assert forward.server.reports[-1].loss == backward.server.reports[-1].loss


def test_the_node_ids_do_not_change_the_model() -> None:
    """Flower's simulation draws new random node ids every run: the same replies under other
    ids (their order by id reversed) must give the same model."""
    plain, relabelled = Cluster(), Cluster()
    swap = dict(zip(NODES, NODES[::-1], strict=True))
    for _ in range(3):
        plain.server.aggregate(plain.round + 1, plain.replies())
        replies = [dataclasses.replace(r, node_id=swap[r.node_id]) for r in relabelled.replies()]
        relabelled.server.aggregate(relabelled.round, replies)  # replies() counted the round
    assert plain.server.shadow.fingerprint() == relabelled.server.shadow.fingerprint()
    assert plain.server.reports[-1].loss == relabelled.server.reports[-1].loss


def test_catch_up_by_log_and_by_snapshot() -> None:
    cluster = Cluster(update_log_size=2)
    cluster.step()
    cluster.step((11, 12))  # 13 and 14 (at version 0, about to get 1) miss version 2 too
    plan = cluster.server.plan_round(99, NODES)
    assert [v for v, _ in plan[11].updates] == [2]
    assert [v for v, _ in plan[13].updates] == [1, 2] and plan[13].snapshot is None
    for _ in range(3):
        cluster.step((11, 12))  # now 13 and 14 are 4 versions behind a 2-entry log
    plan = cluster.server.plan_round(99, NODES)
    assert plan[13].snapshot is not None and plan[13] is plan[14]  # one shared instruction
    cluster.server.nodes.end_round()
    cluster.step()
    versions = {s.replica.version for s in cluster.states.values() if s.replica}
    assert versions == {5}  # everyone computed on version 5 (13 and 14 via the snapshot)
    fingerprints = {s.replica.fingerprint() for s in cluster.states.values() if s.replica}
    assert fingerprints == {cluster.server.fingerprints[5]}
    assert cluster.server.reports[-1].replicas_equal is True


def test_each_reason_drops_the_reply_and_teaches_the_node_book() -> None:
    cluster = Cluster()
    cluster.step()
    replies = cluster.replies()
    good, stale, liar, resync = replies
    stale = dataclasses.replace(stale, model_version=0)
    liar = dataclasses.replace(liar, fingerprint="00" * 16)
    resync = ClientReply.resync_request(resync.node_id, -1)
    stranger = dataclasses.replace(good, node_id=99)
    broken = ParseFailure(55, ReplyError("node 55 replied with error: boom"))
    report = cluster.server.aggregate(2, [good, stale, liar, resync, stranger, broken])
    assert report.accepted == [good.node_id]
    assert "is at version 0" in report.dropped[stale.node_id]
    assert "fingerprint mismatch" in report.dropped[liar.node_id]
    assert "resync from version -1" in report.dropped[resync.node_id]
    assert "not sent a message" in report.dropped[99]
    assert "boom" in report.dropped[55]
    assert report.replicas_equal is False
    book = cluster.server.nodes
    assert book.known_version(stale.node_id) == 0
    assert book.known_version(liar.node_id) == -1
    assert book.known_version(resync.node_id) == -1
    assert book.needs_compressor(resync.node_id, "ternary-base3")
    assert not book.needs_compressor(good.node_id, "ternary-base3")
    plan = cluster.server.plan_round(3, NODES)
    assert [v for v, _ in plan[stale.node_id].updates] == [1, 2]
    assert plan[liar.node_id].snapshot is not None and plan[resync.node_id].snapshot is not None


def test_a_reply_is_accepted_once_per_round() -> None:
    cluster = Cluster()
    replies = cluster.replies()
    report = cluster.server.aggregate(1, [*replies, replies[0]])
    assert len(report.accepted) == len(NODES)
    assert "already replied" in report.dropped[replies[0].node_id]


def test_undecodable_payload_is_dropped_but_the_node_keeps_its_version() -> None:
    cluster = Cluster()
    replies = cluster.replies()
    bad = dataclasses.replace(replies[0], payload=replies[0].payload[:-3])  # type: ignore[index]
    report = cluster.server.aggregate(1, [bad, *replies[1:]])
    assert "payload rejected" in report.dropped[bad.node_id]
    assert cluster.server.nodes.known_version(bad.node_id) == 0  # it holds version 0
    assert report.accepted == sorted(r.node_id for r in replies[1:])


def test_fewer_than_min_replies_skips_the_round() -> None:
    cluster = Cluster(min_replies=3)
    replies = cluster.replies()
    report = cluster.server.aggregate(1, replies[:2])
    assert report.skipped and report.version == 0 and len(report.accepted) == 2
    assert cluster.server.shadow.version == 0 and len(cluster.server.log) == 0


def test_shared_scale_sum_downlink_is_exact_after_the_first_round() -> None:
    cluster = Cluster(downlink="shared-scale-sum", compressor="ternary")
    cluster.step()
    assert cluster.server.reports[0].downlink_format == "encoded"  # no shared scales yet
    assert cluster.server.shared_scales is not None
    replies = cluster.replies()
    seen: list[dict[str, torch.Tensor]] = []
    encode = cluster.server.encode_downlink

    def spy(server_round, aggregate):  # type: ignore[no-untyped-def]
        seen.append({k: v.clone() for k, v in aggregate.gradient.items()})
        return encode(server_round, aggregate)

    cluster.server.encode_downlink = spy  # type: ignore[method-assign]
    report = cluster.server.aggregate(2, replies)
    assert report.downlink_format == "shared-scale-sum"
    applied = decode_broadcast(cluster.server.log.since(1)[0][1])
    for name, mean in seen[0].items():
        torch.testing.assert_close(applied[name], mean, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bare", [False, True])
def test_pooled_statistics_travel_in_the_one_sealed_downlink(bare: bool) -> None:
    """The default downlink seals the BatchNorm statistics into its bundle once; an override
    that returns a bare gradient gets them added; both replicas stay equal."""
    cluster = Cluster(arch="resnet8", learning_rate=0.05)
    if bare:

        def bare_gradient(server_round, aggregate):  # type: ignore[no-untyped-def]
            fp32 = get_compressor("identity")
            return TAG_ENCODED + encode_update(aggregate.gradient, fp32), "own"

        cluster.server.encode_downlink = bare_gradient  # type: ignore[method-assign]
    cluster.step()
    payload = cluster.server.log.since(0)[0][1]
    update, statistics = decode_broadcast_parts(payload)
    assert payload[:1] == TAG_BUNDLE and statistics and update
    assert cluster.server.reports[0].downlink_format == ("own" if bare else "encoded")
    cluster.replies()
    for state in cluster.states.values():
        assert state.replica is not None
        assert state.replica.fingerprint() == cluster.server.shadow.fingerprint()


def test_running_mean_and_code_sums_match_a_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    scales = {"a": 0.5, "b": 2.0}
    grads = [
        {k: s * torch.randint(-1, 2, (3, 4), generator=gen).float() for k, s in scales.items()}
        for _ in range(5)
    ]
    replies = [ClientReply(i, 0, "", b"", 1, 0.0) for i in range(5)]
    result = running_mean((Contribution(r, g) for r, g in zip(replies, grads, strict=True)), scales)
    for name, s in scales.items():
        stacked = torch.stack([g[name] for g in grads])
        torch.testing.assert_close(result.gradient[name], stacked.mean(dim=0))
        assert result.code_sums is not None
        assert torch.equal(result.code_sums[name], (stacked / s).sum(dim=0).reshape(-1).int())
    grads[2]["a"][0, 0] = 0.25  # not ternary at 0.5: no exact sums
    again = running_mean((Contribution(r, g) for r, g in zip(replies, grads, strict=True)), scales)
    assert again.code_sums is None and len(again.contributors) == 5
    assert running_mean(iter(())).contributors == []


def test_node_book_learns_only_from_the_verdict() -> None:
    book = NodeBook()
    reply = ClientReply(7, 3, "ab" * 16, b"x", 1, 0.0)
    assert book.known_version(7) == 0 and book.needs_compressor(7, "ternary")
    book.learn(reply, UnexpectedReply("not asked"))
    assert book.known_version(7) == 0
    book.sent(7, 3, "ternary")
    book.learn(reply, None)
    assert book.known_version(7) == 3 and not book.needs_compressor(7, "ternary")
    assert book.needs_compressor(7, "identity")  # e.g. after the fp32 warm-up rounds
    assert book.expected_version(7) is None  # consumed
    book.sent(7, 4, "ternary")
    book.learn(reply, VersionMismatch("old"))
    assert book.known_version(7) == 3
    book.sent(7, 4, "ternary")
    book.learn(dataclasses.replace(reply, model_version=4), FingerprintMismatch("diverged"))
    assert book.known_version(7) == -1
    book.sent(7, 4, "ternary")
    book.learn(ClientReply.resync_request(7, -1), ResyncRequest("lost state"))
    assert book.known_version(7) == -1 and book.needs_compressor(7, "ternary")
    book.forget(unknown_version=-1)
    assert book.known_version(8) == -1


def test_server_settings_are_checked() -> None:
    model_fn = AppConfig().model_factory()
    with pytest.raises(ValueError, match="downlink"):
        ReplicaServer(model_fn, downlink="nope")
    with pytest.raises(ValueError, match="min_replies"):
        ReplicaServer(model_fn, min_replies=0)
    with pytest.raises(ValueError, match="unknown compressor"):
        ReplicaServer(model_fn, compressor="nope")


def test_error_feedback_goes_through_the_residual_memory() -> None:
    """The worker's residual is what its payload left out (compensated - decoded)."""
    cluster = Cluster(error_feedback=True)
    cluster.step()
    state = cluster.states[11]
    before = state.memory.residuals
    logits = {"3.weight", "3.bias"}  # fp32 by default: nothing left out, no residual
    assert all(bool(r.abs().sum() > 0) == (k not in logits) for k, r in before.items())
    grads = {k: torch.randn_like(v) for k, v in before.items()}
    compensated = {k: g + before[k] for k, g in grads.items()}
    payload = encode_update(grads, get_compressor("ternary", seed=1), state.memory)
    sent = decode_update(payload)
    for name, residual in state.memory.residuals.items():
        torch.testing.assert_close(residual, compensated[name] - sent[name])


def test_a_dense_tensor_that_is_not_finite_in_float32_is_dropped() -> None:
    # The logits travel dense (fp32 exemption); a float64 entry can hold values that are
    # finite in float64 but overflow float32, where the server aggregates. No scale bound:
    # nothing clamps them before the decoded values are checked.
    cluster = Cluster(scale_bound=0)
    replies = cluster.replies()
    good = replies[0]
    assert good.payload is not None
    grads = decode_update(good.payload)
    dense = frozenset(n for n, g in grads.items() if n.startswith("3."))
    grads["3.bias"] = torch.full(grads["3.bias"].shape, 1e300, dtype=torch.float64)
    buckets = cluster.server.scale_bucket  # the run's scale buckets: only the bias is wrong
    compressor = get_compressor("ternary-base3", seed=0, scale_bucket=buckets)
    payload = encode_update(grads, compressor, dense=dense)
    bad = dataclasses.replace(good, payload=payload)
    report = cluster.server.aggregate(1, [bad, *replies[1:]])
    assert "'3.bias'" in report.dropped[bad.node_id]
    assert "non-finite" in report.dropped[bad.node_id]
    assert report.accepted == sorted(r.node_id for r in replies[1:])
    assert cluster.server.shadow.version == 1
    assert all(bool(torch.isfinite(p).all()) for p in cluster.server.shadow.model.parameters())


def test_small_replies_decoded_in_batches_give_the_model_decoding_one_by_one_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batched, single = Cluster(), Cluster()
    sizes: list[int] = []
    real = admission_module.decode_small_batch

    def counted(messages: list[OpenedMessage], like: dict[str, torch.Tensor]) -> object:
        sizes.append(len(messages))
        return real(messages, like)

    monkeypatch.setattr(admission_module, "decode_small_batch", counted)
    for _ in range(3):
        batched.step()
        with monkeypatch.context() as one_by_one:
            one_by_one.setattr(admission_module, "BATCH_DECODE_BYTES", 1)  # batches of one reply
            single.step()
    assert sizes == [len(NODES), 1, 1, 1, 1] * 3
    assert batched.server.shadow.fingerprint() == single.server.shadow.fingerprint()
    assert [r.loss for r in batched.server.reports] == [r.loss for r in single.server.reports]


def test_a_reply_with_an_invalid_code_is_dropped_from_its_batch_alone() -> None:
    cluster = Cluster()
    replies = cluster.replies()
    payload = replies[1].payload
    assert payload is not None
    entries = read_header(payload)
    ternary = next(e for e in entries if e.codec == "base3")
    offset = len(payload) - 4 - sum(e.data_bytes for e in entries)
    offset += sum(e.data_bytes for e in entries[: entries.index(ternary)])
    if ternary.bucket:  # the codes follow the bucket scales
        offset += 4 * math.ceil(math.prod(ternary.shape) / ternary.bucket)
    body = bytearray(payload[:-4])
    body[offset] = 0xFF  # a base-3 byte >= 243, in a message whose CRC is right
    bad = dataclasses.replace(replies[1], payload=bytes(body) + struct.pack("<I", zlib.crc32(body)))
    report = cluster.server.aggregate(1, [replies[0], bad, *replies[2:]])
    assert "invalid base-3 byte" in report.dropped[bad.node_id]
    assert report.accepted == sorted(r.node_id for r in replies if r is not replies[1])
    assert report.version == 1


def test_a_failing_batch_decode_falls_back_to_decoding_reply_by_reply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failing, plain = Cluster(), Cluster()

    def broken(messages: list[OpenedMessage], like: dict[str, torch.Tensor]) -> object:
        raise IndexError("a decoder bug")

    monkeypatch.setattr(admission_module, "decode_small_batch", broken)
    report = failing.server.aggregate(1, failing.replies())
    monkeypatch.undo()
    plain.step()
    assert report.accepted == sorted(NODES) and not report.skipped
    assert failing.server.shadow.fingerprint() == plain.server.shadow.fingerprint()


def test_admission_runs_its_checks_in_the_listed_order() -> None:
    """A reply failing several checks is dropped for the first listed: round, header,
    local scales, statistics."""
    names = [check.__name__ for check in admission_module.REPLY_CHECKS]
    assert names == ["check_round", "check_header", "check_local_scales", "check_statistics_of"]
    cluster = Cluster(downlink="shared-scale-sum", compressor="ternary")
    good = cluster.replies()
    stale = dataclasses.replace(good[0], model_version=7, payload=b"junk")  # round + header
    junk = dataclasses.replace(good[1], payload=b"junk", scales=torch.ones(1))  # header + scales
    short = dataclasses.replace(good[2], scales=torch.ones(1), statistics=b"x")  # scales + stats
    report = cluster.server.aggregate(1, [stale, junk, short, good[3]])
    assert "is at version 7, expected 0" in report.dropped[stale.node_id]
    assert "payload rejected" in report.dropped[junk.node_id]
    assert "local scales" not in report.dropped[junk.node_id]
    assert "local scales for 4 tensors" in report.dropped[short.node_id]
    assert report.accepted == [good[3].node_id]


def test_one_journal_replay_skips_applied_updates_and_stops_at_a_gap_or_a_bad_update() -> None:
    from fedddl.replica import Replica
    from fedddl.sync.journal import replay

    cluster = Cluster()
    for _ in range(3):
        cluster.step()
    logged = cluster.server.log.since(0)
    assert [v for v, _ in logged] == [1, 2, 3]

    def fresh() -> Replica:
        cfg = cluster.cfg
        return Replica(cfg.model_factory()(), cfg.learning_rate, cfg.momentum, version=0)

    replica = fresh()
    applied = list(replay(replica, [logged[0], logged[0], *logged[1:]]))  # a repeat: skipped
    assert applied == logged and replica.fingerprint() == cluster.server.shadow.fingerprint()
    replica = fresh()
    assert list(replay(replica, [logged[0], logged[2]])) == logged[:1]  # a gap: stop
    assert replica.version == 1
    replica = fresh()
    bad = (2, b"not a broadcast")
    assert list(replay(replica, [logged[0], bad, logged[2]])) == logged[:1]  # bad: stop
    assert replica.version == 1
