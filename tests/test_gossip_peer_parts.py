"""The parts a gossip PeerNode is composed of: frame checks, held frames, send backoff."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import torch

from fedddl.gossip.admission import RejectedFrame
from fedddl.gossip.compressed import LINK_OUT_OF_SYNC
from fedddl.gossip.frame_checks import check_frame
from fedddl.gossip.held_frames import NOT_READY, HeldFrames
from fedddl.gossip.inbox import Inbox
from fedddl.gossip.node_metrics import NodeCounters, counter_metrics
from fedddl.gossip.peer_backoff import FINISHED, PeerBackoff, failure_kind
from fedddl.gossip.scheduler import PeerState
from fedddl.gossip.transport import TransportError
from fedddl.gossip.wire import Frame, FrameKind, decode_frame, encode_frame

_SPEC = {"w": ((2, 2), torch.float32)}


def _frame(kind: FrameKind, sender: int, tensors: dict[str, torch.Tensor] | None = None) -> Frame:
    state = PeerState(sender, True, 3)
    if kind is FrameKind.MODEL:
        return decode_frame(encode_frame(kind, sender, state, tensors or {}))
    return decode_frame(encode_frame(kind, sender, state))


def _key(call: Callable[[], object]) -> str:
    with pytest.raises(RejectedFrame) as info:
        call()
    return info.value.key


def test_frame_checks_identity_mode_and_layout() -> None:
    good = _frame(FrameKind.MODEL, 2, {"w": torch.zeros(2, 2)})
    check_frame(good, 1, 2, True, False, _SPEC)  # passes
    assert _key(lambda: check_frame(good, 1, None, True, False, _SPEC)) == "no-identity"
    assert _key(lambda: check_frame(good, 1, 5, True, False, _SPEC)) == "identity-mismatch"
    assert _key(lambda: check_frame(good, 2, None, False, False, _SPEC)) == "claims-me"
    assert _key(lambda: check_frame(good, 1, None, False, True, _SPEC)) == "wrong-mode"
    wrong = _frame(FrameKind.MODEL, 2, {"w": torch.zeros(2, 3)})
    assert _key(lambda: check_frame(wrong, 1, None, False, False, _SPEC)) == "model-mismatch"
    named = _frame(FrameKind.MODEL, 2, {"v": torch.zeros(2, 2)})
    assert _key(lambda: check_frame(named, 1, None, False, False, _SPEC)) == "model-mismatch"
    check_frame(_frame(FrameKind.STATE, 2), 1, None, False, True, _SPEC)  # states pass either mode


def test_held_frames_one_model_frame_per_sender_and_a_limit() -> None:
    held = HeldFrames(limit=2)
    model = _frame(FrameKind.MODEL, 2, {"w": torch.zeros(2, 2)})
    held.hold(model, 10)
    with pytest.raises(RejectedFrame) as info:
        held.hold(model, 10)  # a second model frame from node 2
    assert NOT_READY in info.value.reason and info.value.code is grpc.StatusCode.UNAVAILABLE
    first, newer = _frame(FrameKind.STATE, 3), _frame(FrameKind.STATE, 3)
    held.hold(first, 1)
    held.hold(newer, 2)  # replaces node 3's held state, keeps its slot
    assert _key(lambda: held.hold(_frame(FrameKind.STATE, 4), 1)) == "not-ready"  # full
    taken = held.take()
    assert [(f.sender, n) for f, n in taken] == [(2, 10), (3, 2)]
    assert held.take() == []


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (TransportError(5, grpc.StatusCode.UNAVAILABLE, FINISHED), "finished"),
        (TransportError(5, grpc.StatusCode.UNAVAILABLE, f"{NOT_READY}: retry"), "not-ready"),
        (TransportError(5, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limit"), "rate-limited"),
        (TransportError(5, grpc.StatusCode.FAILED_PRECONDITION, LINK_OUT_OF_SYNC), "out-of-sync"),
        (TransportError(5, grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), "failed"),
        (ValueError("peer 3 answered with a STATE"), "failed"),
    ],
)
def test_failure_kind(exc: Exception, kind: str) -> None:
    assert failure_kind(exc) == kind


def test_backoff_grows_on_failures_and_clears_on_success() -> None:
    backoff = PeerBackoff(max_model_rate=4.0)
    waits = [backoff.failed(7, "failed", 100.0) for _ in range(7)]
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert not backoff.ready(7, 104.9) and backoff.ready(7, 105.0)
    backoff.succeeded(7)
    assert backoff.ready(7, 100.0) and backoff.failed(7, "failed", 0.0) == 0.25
    assert backoff.failed(8, "rate-limited", 10.0) == 0.25  # one slot at 4 frames/s
    assert backoff.failed(9, "not-ready", 10.0) == pytest.approx(0.1)
    assert backoff.failed(10, "out-of-sync", 10.0) == 0.0 and backoff.ready(10, 10.0)
    backoff.failed(11, "finished", 10.0)
    assert backoff.ready(11, 10.0) and not backoff.choosable(11, 1e9)


def test_counter_metrics_are_json_keyed_by_peer() -> None:
    counters = NodeCounters(received_from={1: 2, 3: 1}, sent_to={1: 4})
    counters.count_transfer(1, 0.5)
    counters.count_transfer(1, 1.5)
    out = counter_metrics(counters)
    assert out["received"] == 3 and out["sent_to"] == {"1": 4}
    assert out["mean_transfer_s"] == {"1": 1.0}


def test_inbox_keeps_the_newest_model_per_sender_and_sums_edge_updates() -> None:
    inbox = Inbox()
    inbox.add_model(2, {"w": torch.zeros(2)}, 3)
    inbox.add_model(2, {"w": torch.ones(2)}, 5)  # replaces node 2's older model
    inbox.add_correction({"w": torch.tensor([1.0, 2.0])}, 4)
    inbox.add_correction({"w": torch.tensor([0.5, 0.5])}, None)  # one's own side
    assert len(inbox) == 3
    got = inbox.take()
    assert list(got.models) == [2] and got.models[2][1] == 5
    assert got.correction is not None and torch.equal(got.correction["w"], torch.tensor([1.5, 2.5]))
    assert (got.corrections, got.correction_version, len(got)) == (2, 4, 3)
    assert len(inbox) == 0 and inbox.take().correction_version == 4  # the clock carries over
