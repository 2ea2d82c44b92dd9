"""The start-up race: frames that arrive before a node has its peer list are held, not refused.

Seen before the fix in 2 of 8 runs: one node got its peer list and sent its
first frame before the other had read its own, and the other answered "sender
... is not a known peer" (then the sender backed off for seconds).
"""

from __future__ import annotations

import time

import grpc

from fedddl.gossip.scheduler import PeerState
from fedddl.gossip.wire import FrameKind, encode_frame
from fedddl.models import create_model
from tests.support.gossip_nodes import make_node, model_frame, raw_send


def test_frames_before_the_peer_list_are_held_then_admitted() -> None:
    node = make_node(0, clip=0.0)  # unclipped: it never steps, so a clip would merge nothing
    node.serve()  # serving, but no peer list yet and no training
    address = node.server.address
    other = {k: v + 1.0 for k, v in create_model("digits", seed=1).state_dict().items()}
    state = encode_frame(FrameKind.STATE, 1, PeerState(1, True, 3))
    try:
        assert raw_send(address, model_frame(other, 1))[0] == grpc.StatusCode.OK  # held
        assert raw_send(address, state)[0] == grpc.StatusCode.OK  # held next to it
        code, details = raw_send(address, model_frame(other, 1))  # one model per sender
        assert code == grpc.StatusCode.UNAVAILABLE and "not ready" in details
        assert raw_send(address, model_frame(other, 7))[0] == grpc.StatusCode.OK  # held too
        before = node.fingerprint()
        assert node.merge_pending() == 0 and node.fingerprint() == before

        node.set_peers({1: "127.0.0.1:1"})
        node.start_training(run_threads=False)
        assert node.merge_pending() == 1 and node.fingerprint() != before
        metrics = node.metrics()
        assert metrics["received_from"] == {"1": 1}
        assert metrics["held"] == 3 and metrics["held_dropped"] == 1
        # Only the sender that never made the peer list was refused.
        assert metrics["rejections"] == {"node 1": {"not-ready": 1},
                                         "node 7": {"unknown-sender": 1}}
    finally:
        node.stop(grace_s=0)


def test_a_node_that_gets_its_peer_list_late_loses_nothing() -> None:
    # The early node trains at least 2 s, so it is still running (and receiving) when the
    # late one starts 0.5 s after it, however loaded the machine is.
    early = make_node(1, steps=200, min_step_s=0.01)
    late = make_node(0, steps=60, min_step_s=0.01)
    for node in (early, late):
        node.serve()
    addresses = {0: late.server.address, 1: early.server.address}
    try:
        early.set_peers(addresses)
        early.start_training()  # sends to node 0 at once
        time.sleep(0.5)
        late.set_peers(addresses)
        late.start_training()
        assert early.wait_done(60) and late.wait_done(60)
    finally:
        for node in (early, late):
            node.stop(grace_s=0)
    first, second = early.metrics(), late.metrics()
    assert second["held"] >= 1 and second["held_dropped"] == 0
    assert second["received_from"].get("1", 0) > 0 and first["received_from"].get("0", 0) > 0
    assert "unknown-sender" not in str(second["rejections"])
    assert first["send_failures"] == 0, first  # "not ready" is retried, never a failure
