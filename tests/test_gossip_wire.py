"""Gossip frame format: round trips and every way a frame can be bad."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedddl.gossip.peer_files import format_peers, parse_peers
from fedddl.gossip.scheduler import PeerState
from fedddl.gossip.wire import (
    FrameKind,
    WireError,
    decode_frame,
    encode_frame,
    peer_state_from_json,
    peer_state_to_json,
)

STATE = PeerState(3, True, 17, {0: 0.25, 5: 1.5}, 12.5)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 3, generator=gen),
        "b": torch.randn(3, generator=gen, dtype=torch.float64),
        "count": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 2),
    }


def _reframe(frame: bytes, header: dict[str, object] | None = None, payload: bytes | None = None,
             kind: int | None = None, crc: int | None = None) -> bytes:
    """Rebuild a frame with some parts replaced and, unless given, a correct CRC."""
    prefix = struct.Struct("<4sBBHIQI")
    magic, version, old_kind, reserved, hlen, _, _ = prefix.unpack_from(frame)
    raw_header = frame[prefix.size : prefix.size + hlen]
    raw_payload = frame[prefix.size + hlen :]
    new_header = raw_header if header is None else json.dumps(header).encode()
    new_payload = raw_payload if payload is None else payload
    new_crc = zlib.crc32(new_payload, zlib.crc32(new_header)) if crc is None else crc
    return prefix.pack(magic, version, old_kind if kind is None else kind, reserved,
                       len(new_header), len(new_payload), new_crc) + new_header + new_payload


def test_model_frame_round_trip_is_exact() -> None:
    tensors = _tensors()
    frame = decode_frame(encode_frame(FrameKind.MODEL, 3, STATE, tensors))
    assert frame.kind is FrameKind.MODEL and frame.sender == 3
    assert frame.state == STATE
    assert list(frame.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert frame.tensors[name].dtype == tensor.dtype
        assert torch.equal(frame.tensors[name], tensor)


def test_decoded_tensors_are_writable_copies() -> None:
    data = encode_frame(FrameKind.MODEL, 3, STATE, {"w": torch.ones(3)})
    tensor = decode_frame(data).tensors["w"]
    tensor += 1  # would fail / alias the buffer if it were a view of the bytes
    assert torch.equal(decode_frame(data).tensors["w"], torch.ones(3))


def test_state_and_ack_frames_carry_no_tensors() -> None:
    for kind in (FrameKind.STATE, FrameKind.ACK):
        frame = decode_frame(encode_frame(kind, 3, STATE))
        assert frame.kind is kind and frame.tensors == {} and frame.state == STATE
    with pytest.raises(ValueError, match="only MODEL frames"):
        encode_frame(FrameKind.STATE, 3, STATE, {"w": torch.ones(1)})


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda f: b"", "truncated"),
        (lambda f: f[:10], "truncated"),
        (lambda f: f[:-1], "does not match its header"),
        (lambda f: f + b"x", "does not match its header"),
        (lambda f: b"XXXX" + f[4:], "bad magic"),
        (lambda f: f[:4] + b"\x09" + f[5:], "version"),
        (lambda f: f[:5] + b"\x63" + f[6:], "unknown frame kind"),
        (lambda f: f[:6] + b"\x01\x00" + f[8:], "reserved"),
        (lambda f: f[:-3] + bytes([f[-3] ^ 0xFF]) + f[-2:], "checksum"),
        (lambda f: f[:30] + bytes([f[30] ^ 0x01]) + f[31:], "checksum"),
        (lambda f: bytes(range(256)) * 4, "bad magic"),
    ],
    ids=["empty", "prefix-only", "truncated", "trailing", "magic", "version", "kind", "reserved",
         "payload-bitflip", "header-bitflip", "garbage"],
)
def test_corrupted_frames_are_rejected_with_reason(mutate: object, reason: str) -> None:
    good = encode_frame(FrameKind.MODEL, 3, STATE, _tensors())
    assert callable(mutate)
    with pytest.raises(WireError, match=reason):
        decode_frame(mutate(good))


def test_oversized_frame_is_rejected_before_parsing() -> None:
    frame = encode_frame(FrameKind.MODEL, 3, STATE, {"w": torch.zeros(1000)})
    decode_frame(frame, max_bytes=len(frame))
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_frame(frame, max_bytes=len(frame) - 1)


def test_inconsistent_headers_are_rejected_even_with_a_valid_checksum() -> None:
    good = encode_frame(FrameKind.MODEL, 3, STATE, {"w": torch.zeros(2, 2)})
    header = json.loads(good[24 : 24 + struct.unpack_from("<I", good, 8)[0]])

    def with_spec(**changes: object) -> dict[str, object]:
        return {**header, "tensors": [{**header["tensors"][0], **changes}]}

    cases = {
        "runs past the end": _reframe(good, header=with_spec(shape=[3, 3])),
        "not described by the header": _reframe(good, header=with_spec(shape=[2, 1])),
        "unsupported dtype": _reframe(good, header=with_spec(dtype="complex64")),
        "shape must be a list": _reframe(good, header=with_spec(shape=[2, -2])),
        "no valid name": _reframe(good, header=with_spec(name="")),
        "sender must be": _reframe(good, header={**header, "sender": "x"}),
        "does not match its state": _reframe(good, header={**header, "sender": 4}),
        "node_id must be": _reframe(good, header={**header, "state": {"node_id": -1}}),
        "must not carry tensors": _reframe(good, kind=int(FrameKind.ACK)),
    }
    bad_json = b"{not json"
    cases["not valid UTF-8 JSON"] = (
        struct.pack("<4sBBHIQI", b"FGSP", 1, 1, 0, len(bad_json), 0, zlib.crc32(bad_json))
        + bad_json
    )
    for reason, frame in cases.items():
        with pytest.raises(WireError, match=reason):
            decode_frame(frame)


def test_duplicate_tensor_names_are_rejected() -> None:
    good = encode_frame(FrameKind.MODEL, 3, STATE, {"w": torch.zeros(2)})
    header = json.loads(good[24 : 24 + struct.unpack_from("<I", good, 8)[0]])
    header["tensors"] = header["tensors"] * 2
    payload = good[24 + struct.unpack_from("<I", good, 8)[0] :]
    with pytest.raises(WireError, match="appears twice"):
        decode_frame(_reframe(good, header=header, payload=payload * 2))


def test_peer_state_json_validation() -> None:
    assert peer_state_from_json(peer_state_to_json(STATE)) == STATE
    good = peer_state_to_json(STATE)
    for key, value, reason in [
        ("enabled", 1, "enabled must be a bool"),
        ("model_version", -1, "model_version"),
        ("est_comm_time_s", {"a": 1.0}, "estimate key"),
        ("est_comm_time_s", {"1": -1.0}, "must be a number >= 0"),
        ("steps_per_s", float("nan"), "steps_per_s"),
    ]:
        with pytest.raises(WireError, match=reason):
            peer_state_from_json({**good, key: value})
    with pytest.raises(WireError, match="must be an object"):
        peer_state_from_json([1, 2])


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3), max_size=4),
    sender=st.integers(0, 2**31),
    version=st.integers(0, 2**40),
)
def test_round_trip_property(shapes: list[list[int]], sender: int, version: int) -> None:
    tensors = {f"t{i}": torch.arange(float(torch.Size(s).numel())).reshape(s)
               for i, s in enumerate(shapes)}
    state = PeerState(sender, False, version)
    frame = decode_frame(encode_frame(FrameKind.MODEL, sender, state, tensors))
    assert frame.state == state
    assert all(torch.equal(frame.tensors[k], v) for k, v in tensors.items())


def test_peer_list_parsing() -> None:
    peers = parse_peers("0=127.0.0.1:5000, 2=host.example:6000")
    assert peers == {0: "127.0.0.1:5000", 2: "host.example:6000"}
    assert parse_peers(format_peers(peers)) == peers
    for bad in ["0=127.0.0.1", "x=h:1", "0=h:1,0=h:2", "0:h:1", "0=:5"]:
        with pytest.raises(ValueError, match="peer"):
            parse_peers(bad)
