"""The sending half of a gossip node, driven directly with fake peer clients."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import torch

from fedddl.gossip.admission import Admission, AdmissionLimits, RejectionLog
from fedddl.gossip.compressed import LINK_OUT_OF_SYNC, CompressedGossip
from fedddl.gossip.estimator import CommTimeEstimator
from fedddl.gossip.node_config import NodeConfig
from fedddl.gossip.peer_backoff import FINISHED
from fedddl.gossip.scheduler import PeerState, get_scheduler
from fedddl.gossip.sender import Sender, SenderHooks, first_frame_bytes
from fedddl.gossip.shared_state import SharedState
from fedddl.gossip.transport import SendResult, TransportError
from fedddl.gossip.wire import Frame, FrameKind, decode_frame, encode_frame

ME = 1
Tensors = dict[str, torch.Tensor]


class FakeClient:
    """A peer client that records frames and answers with an ACK (or raises ``fail``)."""

    def __init__(self, peer: int, version: int = 0, sender: int | None = None) -> None:
        self.peer = peer
        self.version = version  # the clock the peer's ACK carries
        self.sender = peer if sender is None else sender
        self.fail: Exception | None = None
        self.frames: list[Frame] = []
        self.sizes: list[int] = []

    def send(self, frame: bytes, timeout_s: float) -> SendResult:
        self.frames.append(decode_frame(frame))
        self.sizes.append(len(frame))
        if self.fail is not None:
            raise self.fail
        state = PeerState(self.sender, True, self.version)
        return SendResult(encode_frame(FrameKind.ACK, self.sender, state), 0.01, 0.0)

    def close(self) -> None:
        """Nothing to close."""


class FakeNode:
    """The hooks a sender calls: a fixed model at a settable version; records clips."""

    def __init__(self) -> None:
        self.model: Tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
        self.version = 7
        self.clipped: list[tuple[int, Tensors]] = []

    def hooks(self) -> SenderHooks:
        def clipped(peer: int, correction: Tensors) -> Tensors:
            self.clipped.append((peer, correction))
            return {k: v * 0.5 for k, v in correction.items()}

        return SenderHooks(
            own_state=lambda: PeerState(ME, True, self.version),
            version=lambda: self.version,
            snapshot=lambda: (self.version, {k: v.clone() for k, v in self.model.items()}),
            clipped=clipped,
        )


def _sender(
    clients: list[FakeClient],
    compressor: str = "",
    max_model_rate: float = 1000.0,
    state_interval_s: float = 0.2,
) -> tuple[Sender, SharedState, FakeNode, RejectionLog]:
    node = FakeNode()
    limits = AdmissionLimits(max_model_rate=max_model_rate, max_version_jump=100)
    config = NodeConfig(
        node_id=ME, compressor=compressor, limits=limits, state_interval_s=state_interval_s
    )
    gossip = None
    if compressor:
        gossip = CompressedGossip(compressor, node.model, seed=3, consensus_step=0.25)
    shared = SharedState(first_frame_bytes(ME, gossip, node.model), gossip)
    for client in clients:
        shared.clients[client.peer] = client  # type: ignore[assignment]
        shared.peer_states[client.peer] = PeerState(client.peer, True, 0)
    log = RejectionLog(f"node {ME}")
    sender = Sender(
        config, shared, node.hooks(), get_scheduler("random"), CommTimeEstimator(),
        Admission(limits), log,
    )
    return sender, shared, node, log


def test_first_frame_bytes_is_the_size_of_a_model_frame() -> None:
    model = {"w": torch.zeros(4, 5)}
    frame = encode_frame(FrameKind.MODEL, ME, PeerState(ME, True, 0), model)
    assert first_frame_bytes(ME, None, model) == len(frame)
    gossip = CompressedGossip("ternary-base3", model, seed=0)
    state_frame = encode_frame(FrameKind.STATE, ME, PeerState(ME, True, 0))
    assert first_frame_bytes(ME, gossip, model) == len(state_frame) + gossip.expected_bytes()


def test_ship_sends_the_model_and_counts_it() -> None:
    peer = FakeClient(2, version=9)
    sender, shared, node, _ = _sender([peer])
    assert sender.ship_snapshot() == 7
    (frame,) = peer.frames
    assert frame.kind is FrameKind.MODEL and frame.sender == ME
    assert torch.equal(frame.tensors["w"], node.model["w"])
    sent_bytes = len(encode_frame(FrameKind.MODEL, ME, PeerState(ME, True, 7), node.model))
    counters = shared.counters
    assert counters.sent_to == {2: 1} and counters.transfers == {2: 1}
    assert counters.model_bytes_sent == counters.bytes_sent == sent_bytes
    assert shared.frame_bytes == sent_bytes  # what the scheduler plans with next
    assert shared.peer_states[2].model_version == 9  # the reply's state is kept
    assert sender.estimator.snapshot()  # it learnt from the model frame
    assert len(shared.inbox) == 0  # whole models bring no edge update of our own


def test_a_failed_send_backs_the_peer_off_and_disables_it() -> None:
    peer = FakeClient(2)
    peer.fail = TransportError(2, grpc.StatusCode.UNAVAILABLE, "connection refused")
    sender, shared, _, _ = _sender([peer])
    assert sender.ship_snapshot() == -1
    assert shared.counters.send_failures == 1 and not shared.counters.sent_to
    assert shared.peer_states[2].enabled is False
    peer.fail = None
    assert sender.ship_snapshot() is None  # backed off: no peer to choose
    assert len(peer.frames) == 1


def test_a_success_clears_the_backoff(caplog: pytest.LogCaptureFixture) -> None:
    peer = FakeClient(2)
    sender, _, _, _ = _sender([peer])
    down = TransportError(2, grpc.StatusCode.UNAVAILABLE, "connection refused")
    with caplog.at_level(logging.INFO, logger="fedddl.gossip.sender"):
        peer.fail = down
        assert sender.ship_snapshot() == -1
        time.sleep(0.3)  # the first backoff, 0.25 s, passes
        peer.fail = None
        assert sender.ship_snapshot() == 7
        peer.fail = down
        assert sender.ship_snapshot() == -1
    waits = [r.getMessage().rsplit("backing off ", 1)[1] for r in caplog.records]
    assert waits == ["0.25 s", "0.25 s"]  # not 0.50 s: the success reset the count


def test_failure_kinds_are_counted_apart() -> None:
    peer = FakeClient(2)
    sender, shared, _, _ = _sender([peer])
    peer.fail = TransportError(2, grpc.StatusCode.RESOURCE_EXHAUSTED, "over the rate limit")
    assert sender.ship_snapshot() == -1
    assert shared.counters.rate_limited == 1 and shared.counters.send_failures == 0
    assert shared.peer_states[2].enabled  # a rate-limited peer stays enabled
    finished = FakeClient(3)
    finished.fail = TransportError(3, grpc.StatusCode.UNAVAILABLE, FINISHED)
    sender, shared, _, _ = _sender([finished])
    assert sender.ship_snapshot() == -1
    assert sender.ship_snapshot() is None  # a finished peer is never chosen again
    assert shared.counters.send_failures == 0


def test_a_reply_of_another_node_or_kind_is_a_failure() -> None:
    impostor = FakeClient(2, sender=4)
    sender, shared, _, _ = _sender([impostor])
    assert sender.ship_snapshot() == -1
    assert shared.counters.send_failures == 1 and shared.counters.bytes_sent == 0


def test_a_wild_clock_in_a_reply_is_ignored() -> None:
    peer = FakeClient(2, version=10_000)  # past own 7 + max_version_jump 100
    sender, shared, _, log = _sender([peer])
    assert sender.ship_snapshot() == 7  # delivered all the same
    assert shared.peer_states[2].model_version == 0  # but its state is not believed
    assert log.by_status() == {"IGNORED_REPLY": 1}


def test_the_next_model_to_a_peer_waits_for_its_rate_slot() -> None:
    peer = FakeClient(2)
    sender, shared, _, _ = _sender([peer], max_model_rate=0.5)  # one frame per 2 s
    assert sender.ship_snapshot() == 7
    shared.stop.set()  # the wait for the next slot is cut short by the stop
    assert sender.ship_snapshot() is None
    assert len(peer.frames) == 1


def test_compressed_ship_sends_differences_and_keeps_the_edge_update() -> None:
    peer = FakeClient(2)
    sender, shared, node, _ = _sender([peer], compressor="ternary-base3")
    assert sender.ship_snapshot() == 7
    node.model["w"] += 1.0
    node.version = 8
    assert sender.ship_snapshot() == 8
    first, second = peer.frames
    for frame in (first, second):
        assert frame.kind is FrameKind.DELTA and frame.link is not None and not frame.link.key
    assert first.link is not None and second.link is not None
    assert (first.link.seq, second.link.seq) == (0, 1)  # the second builds on the first
    assert shared.counters.key_frames_sent == 0 and shared.counters.sent_to == {2: 2}
    assert shared.frame_bytes == peer.sizes[-1]  # a difference sizes the next plan
    assert [p for p, _ in node.clipped] == [2, 2]  # each edge update went through the clip
    received = shared.inbox.take()
    assert received.corrections == 2 and received.correction is not None
    expected = sum(c["w"] * 0.5 for _, c in node.clipped)
    assert torch.allclose(received.correction["w"], expected)


def test_an_out_of_sync_link_gets_a_key_frame_next() -> None:
    peer = FakeClient(2)
    sender, shared, node, _ = _sender([peer], compressor="ternary-base3")
    assert sender.ship_snapshot() == 7
    planned = shared.frame_bytes
    peer.fail = TransportError(2, grpc.StatusCode.FAILED_PRECONDITION, LINK_OUT_OF_SYNC)
    node.version = 8
    assert sender.ship_snapshot() == -1
    assert shared.counters.links_reset == 1 and shared.counters.send_failures == 0
    peer.fail = None
    assert sender.ship_snapshot() == 8
    last = peer.frames[-1]
    assert last.link is not None and last.link.key
    assert shared.counters.key_frames_sent == 1
    assert shared.frame_bytes == planned == peer.sizes[0]  # a key frame does not size a plan
    assert peer.sizes[-1] != planned  # (so the check above could fail)


def test_send_loop_ships_each_version_once_until_done() -> None:
    peer = FakeClient(2)
    sender, shared, _, _ = _sender([peer])
    thread = threading.Thread(target=sender.send_loop, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if peer.frames:
                break
            shared.stop.wait(0.01)
        shared.stop.wait(0.05)  # the same version is not shipped again
        assert len(peer.frames) == 1
    finally:
        shared.done.set()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_state_loop_broadcasts_to_every_peer_and_ends_after_done() -> None:
    peers = [FakeClient(2), FakeClient(3)]
    sender, shared, _, _ = _sender(peers, state_interval_s=0.01)
    thread = threading.Thread(target=sender.state_loop, daemon=True)
    thread.start()
    for _ in range(200):
        if all(p.frames for p in peers):
            break
        shared.stop.wait(0.01)
    shared.done.set()
    thread.join(timeout=5)
    assert not thread.is_alive()  # the loop ends by itself once training is done
    for peer in peers:
        assert peer.frames and all(f.kind is FrameKind.STATE for f in peer.frames)
    # the first state was broadcast once, not re-sent every interval (it did not change)
    assert all(len(p.frames) <= 3 for p in peers)
    assert shared.counters.transfers == {}  # state pings teach the estimator nothing
