"""gRPC peer service: bad frames are refused without touching the model; the shaper is measured."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from fedddl.gossip.estimator import CommTimeEstimator
from fedddl.gossip.peer_node import NodeConfig, PeerNode, TrainingData
from fedddl.gossip.scheduler import PeerState
from fedddl.gossip.transport import (
    LinkDelay,
    LinkShaper,
    PeerClient,
    PeerServer,
    TransportError,
    parse_shaper_spec,
)
from fedddl.gossip.wire import FrameKind, encode_frame
from fedddl.models import create_model
from tests.support.gossip_nodes import raw_send, run_to_completion

MAX_FRAME = 200_000


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _data(seed: int) -> TrainingData:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(64, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)
    return TrainingData(x, y, x[:32], y[:32])


def _node(node_id: int, **config: object) -> PeerNode:
    cfg = NodeConfig(node_id=node_id, max_frame_bytes=MAX_FRAME, **config)  # type: ignore[arg-type]
    return PeerNode(cfg, create_model("digits", seed=0), _data(node_id))


@pytest.fixture()
def receiver() -> Iterator[PeerNode]:
    """Node 0 serving in manual mode (accepts frames, merges only when asked)."""
    node = _node(0, clip=0.0)  # it never steps: unclipped, so a good frame changes the model
    node.serve()
    node.set_peers({1: "127.0.0.1:1", 2: "127.0.0.1:1"})  # senders it knows; never dialled
    node.start_training(run_threads=False)
    yield node
    node.stop(grace_s=0)


def _model_frame(tensors: dict[str, torch.Tensor], sender: int = 1) -> bytes:
    return encode_frame(FrameKind.MODEL, sender, PeerState(sender, True, 5), tensors)


def test_bad_frames_get_an_error_status_and_leave_the_model_untouched(
    receiver: PeerNode, caplog: pytest.LogCaptureFixture
) -> None:
    other = {k: v + 1.0 for k, v in create_model("digits", seed=1).state_dict().items()}
    good = _model_frame(other)
    first = next(iter(other))
    renamed = {("x" + k if k == first else k): v for k, v in other.items()}
    reshaped = {**other, first: other[first].reshape(-1)}
    widened = {**other, first: other[first].double()}
    poisoned = {**other, first: torch.full_like(other[first], float("nan"))}
    flipped = good[:-5] + bytes([good[-5] ^ 0x10]) + good[-4:]
    cases = {
        "garbage": (b"\x00garbage" * 50, grpc.StatusCode.INVALID_ARGUMENT, "bad magic"),
        "truncated": (good[: len(good) // 2], grpc.StatusCode.INVALID_ARGUMENT, "does not match"),
        "checksum": (flipped, grpc.StatusCode.INVALID_ARGUMENT, "checksum"),
        "oversized": (b"\x00" * (MAX_FRAME + 1), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit"),
        "far oversized": (
            b"\x00" * (MAX_FRAME + 3 * 2**20), grpc.StatusCode.RESOURCE_EXHAUSTED, ""
        ),
        "names": (_model_frame(renamed), grpc.StatusCode.FAILED_PRECONDITION, "names differ"),
        "shapes": (_model_frame(reshaped), grpc.StatusCode.FAILED_PRECONDITION, "mine is"),
        "dtype": (_model_frame(widened), grpc.StatusCode.FAILED_PRECONDITION, "float64"),
        "nan": (_model_frame(poisoned), grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
        "stranger": (_model_frame(other, 7), grpc.StatusCode.PERMISSION_DENIED, "not a known"),
        "myself": (_model_frame(other, 0), grpc.StatusCode.PERMISSION_DENIED, "from me"),
    }
    before = receiver.fingerprint()
    for name, (data, code, reason) in cases.items():
        got_code, details = raw_send(receiver.server.address, data)
        assert got_code == code, (name, got_code, details)
        assert reason in details, (name, details)
        assert receiver.merge_pending() == 0, name
        assert receiver.fingerprint() == before, name
    metrics = receiver.metrics()
    assert metrics["received"] == 0 and metrics["merged"] == 0
    assert sum(metrics["rejected"].values()) == len(cases) - 1  # gRPC itself refuses the last
    # Counted per peer and reason: claimed senders for well-formed frames, else the host.
    rejections = metrics["rejections"]
    assert rejections["node 1"] == {"model-mismatch": 3, "non-finite": 1}
    assert rejections["node 7"] == {"unknown-sender": 1}
    assert rejections["ipv4:127.0.0.1"] == {"malformed": 3, "oversized": 1, "claims-me": 1}
    # Logged once per (peer, reason): the checksum failure is the second 'malformed' frame
    # of the same host, so it is only counted.
    lines = [r.getMessage() for r in caplog.records if "rejected frame" in r.getMessage()]
    assert len(lines) == 6, lines
    assert not any("checksum" in line for line in lines)

    # The same service does accept and merge a good frame: the checks above could fail.
    assert raw_send(receiver.server.address, good)[0] == grpc.StatusCode.OK
    assert receiver.merge_pending() == 1
    assert receiver.fingerprint() != before
    assert receiver.metrics()["received_from"] == {"1": 1}


def test_shaper_delay_shows_in_transfer_time_and_estimator_learns_it() -> None:
    server = PeerServer(lambda data, caller: b"ack", max_frame_bytes=MAX_FRAME)
    server.start()
    shaper = LinkShaper(per_peer={1: LinkDelay(latency_s=0.08, bandwidth_Bps=1e6)})
    slow = PeerClient(1, server.address, shaper)
    fast = PeerClient(2, server.address, shaper)
    estimator = CommTimeEstimator(prior_latency_s=0.001, prior_bandwidth_Bps=1e9)
    frame = b"\x01" * 100_000  # shaped: 0.08 s + 0.1 s
    try:
        for client in (slow, fast):
            for _ in range(4):
                result = client.send(frame, timeout_s=5)
                assert result.reply == b"ack"
                estimator.observe(client.peer, len(frame), result.seconds)
                if client is slow:
                    assert result.shaper_delay_s == pytest.approx(0.18)
                    assert result.seconds >= 0.18
                else:
                    assert result.shaper_delay_s == 0.0 and result.seconds < 0.1
    finally:
        slow.close()
        fast.close()
        server.stop(0)
    assert 0.17 <= estimator.estimate(1, len(frame)) < 0.35
    assert estimator.estimate(2, len(frame)) < 0.1


def test_scheduled_node_learns_a_slow_link_and_prefers_the_fast_one() -> None:
    slow_link = LinkShaper(per_peer={2: LinkDelay(latency_s=0.1)})
    nodes = [_node(i, steps=80, min_step_s=0.01, scheduler="scheduled") for i in range(3)]
    nodes[0].shaper = slow_link
    assert run_to_completion(nodes, timeout_s=60)
    m0 = nodes[0].metrics()
    assert m0["mean_transfer_s"]["2"] >= 0.1
    assert m0["mean_transfer_s"]["2"] > m0["mean_transfer_s"]["1"] + 0.05
    assert nodes[0].estimator.estimate(2, 20_000) >= 0.09
    assert nodes[0].estimator.estimate(1, 20_000) < 0.05
    # Learned slowness steers the scheduler to the fast link.
    assert m0["sent_to"].get("1", 0) > 3 * m0["sent_to"].get("2", 0)
    for node in nodes:
        m = node.metrics()
        assert m["finished"] and m["steps"] == 80
        assert m["received"] > 0 and m["merged"] > 0


def test_unreachable_peer_fails_with_transport_error_quickly() -> None:
    server = PeerServer(lambda data, caller: b"", bind="127.0.0.1:0")
    port = server.port  # bound but never started: connections are refused
    client = PeerClient(5, f"127.0.0.1:{port}")
    start = time.perf_counter()
    with pytest.raises(TransportError, match="peer 5"):
        client.send(b"x", timeout_s=0.5)
    assert time.perf_counter() - start < 2.0
    client.close()
    server.stop(0)


def test_shaper_spec_parsing_and_validation() -> None:
    shaper = parse_shaper_spec("*=0.01, 2=0.2/1e6")
    assert shaper.delay_for(1, 1000) == pytest.approx(0.01)
    assert shaper.delay_for(2, 1000) == pytest.approx(0.201)
    assert parse_shaper_spec("").delay_for(1, 10**9) == 0.0
    slept: list[float] = []
    assert LinkShaper(LinkDelay(0.5), sleep=slept.append).apply(3, 0) == 0.5 and slept == [0.5]
    for bad, reason in [("1=-1", "latency"), ("1=0.1/0", "bandwidth"), ("x=1", "bad shaper"),
                        ("1", "missing")]:
        with pytest.raises(ValueError, match=reason):
            parse_shaper_spec(bad)


def test_node_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="steps"):
        NodeConfig(node_id=0, steps=-1)
    with pytest.raises(ValueError, match="merge"):
        NodeConfig(node_id=0, merge="sum")
    with pytest.raises(ValueError, match="unknown scheduler"):
        NodeConfig(node_id=0, scheduler="fastest")
