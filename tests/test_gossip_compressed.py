"""Compressed gossip: public copies stay in step, errors feed back, edge updates cancel."""

from __future__ import annotations

import itertools
import json
import struct
import zlib

import pytest
import torch

from fedddl.compression import IdentityCompressor, decode_update, encode_update
from fedddl.gossip.compressed import (
    CompressedGossip,
    LinkError,
    LinkHeader,
    ReceiverCopies,
    SenderCopies,
    state_fingerprint,
)
from fedddl.gossip.scheduler import PeerState
from fedddl.gossip.wire import FrameKind, WireError, decode_frame, encode_frame
from fedddl.models import create_model


def _initial() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in create_model("digits", seed=0).state_dict().items()}


def _moved(
    state: dict[str, torch.Tensor], seed: int, size: float = 0.05
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + size * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a)) ** 0.5


def test_copies_stay_identical_and_track_the_model_with_error_feedback() -> None:
    initial = _initial()
    sender = SenderCopies("ternary-base3", initial, seed=1)
    receiver = ReceiverCopies(initial)
    model = _moved(initial, 0)
    gaps = []
    for _ in range(30):  # the model stands still: each message closes part of the gap
        update = sender.prepare(5, model)
        copy = receiver.apply(3, update.header, update.payload)
        sender.commit(update)
        assert all(torch.equal(copy[k], sender.copy_at(5)[k]) for k in copy)  # bit-identical
        gaps.append(_distance(copy, model))
    assert all(b <= a for a, b in itertools.pairwise(gaps)), gaps
    assert gaps[-1] < 1e-3 * gaps[0], gaps  # what one message dropped went out with the next
    # Each message is ternary: about 1/20 of the fp32 model plus small headers.
    fp32 = sum(v.numel() * 4 for v in initial.values())
    assert len(update.payload) < fp32 / 12
    assert sender.expected_bytes() == len(update.payload) + update.header.extra_bytes


def test_least_squares_gains_never_grow_the_difference() -> None:
    initial = _initial()
    sender = SenderCopies("ternary", initial, seed=2, clip_sigma=2.5)
    for seed in range(5):
        model = _moved(initial, seed, size=0.3)
        update = sender.prepare(1, model)
        before = _distance(model, initial)
        after = _distance(model, update.copy_after)
        assert after < before
        assert all(0.0 <= g <= 2.0 for g in update.header.gains)


def test_a_lost_message_is_detected_and_a_key_frame_resynchronises() -> None:
    initial = _initial()
    sender = SenderCopies("ternary-base3", initial, seed=1)
    receiver = ReceiverCopies(initial)
    first = sender.prepare(0, _moved(initial, 1))
    receiver.apply(9, first.header, first.payload)
    sender.commit(first)
    lost = sender.prepare(0, _moved(initial, 2))
    sender.commit(lost)  # acked, say, but never applied by the receiver
    third = sender.prepare(0, _moved(initial, 3))
    before = receiver.copy_of(9)
    with pytest.raises(LinkError, match="out of sync") as info:
        receiver.apply(9, third.header, third.payload)
    assert info.value.key == "link-out-of-sync"
    assert all(torch.equal(before[k], receiver.copy_of(9)[k]) for k in before)
    # The same message twice is refused as well (no double application).
    with pytest.raises(LinkError, match="out of sync"):
        receiver.apply(9, first.header, first.payload)
    sender.reset(0)
    model = _moved(initial, 4)
    key = sender.prepare(0, model)
    assert key.header.key and sender.key_frames == 1
    copy = receiver.apply(9, key.header, key.payload)
    sender.commit(key)
    assert all(torch.equal(copy[k], model[k]) for k in model)  # exact: uncompressed
    nxt = sender.prepare(0, _moved(initial, 5))
    assert not nxt.header.key and nxt.header.seq == 1 and nxt.header.base == key.header.base
    receiver.apply(9, nxt.header, nxt.payload)


def test_a_receiver_with_another_initial_model_asks_for_a_key_frame() -> None:
    initial = _initial()
    other = {k: v + 1.0 for k, v in initial.items()}
    update = SenderCopies("ternary-base3", initial, seed=0).prepare(1, _moved(initial, 0))
    assert update.header.base == state_fingerprint(initial) != state_fingerprint(other)
    with pytest.raises(LinkError, match="no public copy"):
        ReceiverCopies(other).apply(0, update.header, update.payload)


def test_bad_payloads_and_out_of_range_copies_leave_the_copy_unchanged() -> None:
    initial = _initial()
    receiver = ReceiverCopies(initial, max_abs_weight=5.0)
    sender = SenderCopies("ternary-base3", initial, seed=0)
    update = sender.prepare(1, _moved(initial, 0))
    header = update.header
    key = LinkHeader("key-1", 0, True)
    flipped = update.payload[:-1] + bytes([update.payload[-1] ^ 1])
    foreign = encode_update({"other": torch.ones(3)}, IdentityCompressor())
    huge = encode_update({k: v + 10.0 for k, v in initial.items()}, IdentityCompressor())
    cases = [
        ("malformed-update", header, flipped),  # checksum
        ("malformed-update", header, foreign),  # not this model's tensors
        ("weight-range", key, huge),
        ("non-finite", key, _inf_payload(initial)),
    ]
    for reason, head, payload in cases:
        with pytest.raises(LinkError) as info:
            receiver.apply(0, head, payload)
        assert info.value.key == reason, (reason, info.value)
        assert receiver.links() == 0
    with pytest.raises(LinkError, match="gains"):
        receiver.apply(0, LinkHeader(header.base, 0, False, header.gains[:1]), update.payload)
    assert receiver.apply(0, header, update.payload)  # the untouched message still applies
    assert receiver.links() == 1


def _inf_payload(initial: dict[str, torch.Tensor]) -> bytes:
    """A dense payload holding an inf (encode_update refuses to make one: patch the bytes)."""
    names = list(initial)
    zeros = {k: torch.zeros_like(v) for k, v in initial.items()}
    payload = bytearray(encode_update(zeros, IdentityCompressor()))
    position = len(payload) - 4 - initial[names[-1]].numel() * 4  # first value of the last one
    payload[position : position + 4] = struct.pack("<f", float("inf"))
    payload[-4:] = struct.pack("<I", zlib.crc32(bytes(payload[:-4])))
    assert not torch.isfinite(decode_update(bytes(payload))[names[-1]]).all()
    return bytes(payload)


def test_edge_updates_of_both_ends_cancel_so_the_average_is_kept() -> None:
    initial = _initial()
    a = CompressedGossip("ternary-base3", initial, seed=1, consensus_step=0.25)
    b = CompressedGossip("ternary-base3", initial, seed=2, consensus_step=0.25)
    xa, xb = _moved(initial, 1, 0.2), _moved(initial, 2, 0.2)
    for step in range(12):
        sender, receiver, x_send, x_recv, ids = (
            (a, b, xa, xb, (0, 1)) if step % 2 == 0 else (b, a, xb, xa, (1, 0))
        )
        update = sender.prepare(ids[1], x_send)
        received = receiver.receive(ids[0], update.header, update.payload)
        sent = sender.commit(update)
        for k in received:
            assert torch.allclose(received[k], -sent[k], atol=1e-6)
            x_recv[k] += received[k]
            x_send[k] += sent[k]
    # Consensus: the two models came closer, with their mean where it was.
    start_a, start_b = _moved(initial, 1, 0.2), _moved(initial, 2, 0.2)
    assert _distance(xa, xb) < 0.6 * _distance(start_a, start_b)
    for k in xa:
        assert torch.allclose(xa[k] + xb[k], start_a[k] + start_b[k], atol=1e-5)


def test_only_float_tensors_travel() -> None:
    state = {"w": torch.randn(4, 4), "count": torch.tensor(3)}
    update = SenderCopies("ternary", state, seed=0).prepare(1, {**state, "count": torch.tensor(9)})
    assert set(decode_update(update.payload)) == {"w"}
    with pytest.raises(ValueError, match="differ"):
        SenderCopies("ternary", state, seed=0).prepare(1, {"v": torch.randn(4, 4)})


def test_delta_frames_round_trip_and_bad_link_headers_are_refused() -> None:
    state = PeerState(2, True, 40, {0: 0.1234567})
    header = LinkHeader("init-abc", 3, False, (0.5, 1.25))
    frame = decode_frame(encode_frame(FrameKind.DELTA, 2, state, link=header, update=b"xyz"))
    assert frame.kind is FrameKind.DELTA and frame.link == header and frame.update == b"xyz"
    assert frame.state.est_comm_time_s == {0: 0.1235}  # 4 significant digits on the wire
    with pytest.raises(ValueError, match="DELTA"):
        encode_frame(FrameKind.MODEL, 2, state, link=header, update=b"x")
    with pytest.raises(ValueError, match="DELTA"):
        encode_frame(FrameKind.DELTA, 2, state)
    good = encode_frame(FrameKind.DELTA, 2, state, link=header, update=b"xyz")
    prefix = struct.Struct("<4sBBHIQI")
    fields = prefix.unpack_from(good)
    raw_header = json.loads(good[prefix.size : prefix.size + fields[4]])
    for link, reason in [(None, "lacks"), ({"base": "b", "seq": -1, "key": False, "gains": []},
                                           "seq"),
                         ({"base": "b", "seq": 0, "key": False, "gains": [9.0]}, "gains"),
                         ({"base": "b", "seq": "0", "key": False, "gains": []}, "needs")]:
        bad = dict(raw_header)
        if link is None:
            bad.pop("link")
        else:
            bad["link"] = link
        body = json.dumps(bad).encode()
        data = prefix.pack(b"FGSP", 1, 4, 0, len(body), 3, zlib.crc32(b"xyz", zlib.crc32(body)))
        with pytest.raises(WireError, match=reason):
            decode_frame(data + body + b"xyz")
