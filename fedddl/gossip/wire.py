"""Peer-to-peer gossip message format.

Every message exchanged between gossip peers is one frame::

    offset size  field
    0      4     magic b"FGSP"
    4      1     format version (1)
    5      1     kind (MODEL=1, STATE=2, ACK=3, DELTA=4)
    6      2     reserved, must be zero
    8      4     header length H (bytes, little-endian uint32)
    12     8     payload length P (bytes, little-endian uint64)
    20     4     CRC32 of header + payload (little-endian uint32)
    24     H     header: UTF-8 JSON object
    24+H   P     payload: MODEL: raw little-endian tensor bytes, concatenated in header
                 order; DELTA: one :func:`fedddl.compression.encode_update` message

The JSON header carries the sender id, the sender's :class:`PeerState` (so
availability and comm-time estimates piggyback on every exchange), for MODEL
frames the name, dtype and shape of every tensor, and for DELTA frames (compressed
gossip, :mod:`fedddl.gossip.compressed`) the link header ``{"base", "seq",
"key", "gains"}``; the compressed update itself is checked by its receiver
(:meth:`~fedddl.gossip.compressed.ReceiverCopies.apply`) against its own model
before anything is allocated. :func:`decode_frame`
checks everything (size limits, magic, version, lengths, checksum, schema,
tensor counts and byte counts) before any tensor is built, so a bad frame raises
:class:`WireError` and never reaches a model. Its default limits (frame bytes, header bytes,
tensors, values) fit real models; a peer with a larger model passes larger ones.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeGuard

import numpy as np
import torch

from fedddl.compression import DEFAULT_MAX_TENSORS
from fedddl.framing import check_crc, check_magic, crc32_of
from fedddl.gossip.compressed import LinkHeader
from fedddl.gossip.scheduler import PeerState

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "Frame",
    "FrameKind",
    "WireError",
    "decode_frame",
    "encode_frame",
    "peer_state_from_json",
    "peer_state_to_json",
]

MAGIC = b"FGSP"
FORMAT_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
#: Largest JSON header :func:`decode_frame` parses unless told otherwise.
DEFAULT_MAX_HEADER_BYTES = 1024 * 1024  # 4,096 tensor specs of 256 bytes
_PREFIX = struct.Struct("<4sBBHIQI")

# Only plain numeric dtypes travel; names are numpy's so the format is language neutral.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class WireError(ValueError):
    """A gossip frame is malformed, truncated, oversized or fails its checksum."""


class FrameKind(IntEnum):
    """What a frame carries."""

    MODEL = 1  # a model snapshot to merge
    STATE = 2  # only the sender's PeerState (availability / estimates)
    ACK = 3  # a reply: the receiver's PeerState
    DELTA = 4  # a compressed difference against a public copy (compressed gossip)

    @property
    def carries_model(self) -> bool:
        """Whether the frame changes the receiver's model (MODEL or DELTA)."""
        return self in (FrameKind.MODEL, FrameKind.DELTA)


@dataclass(frozen=True)
class Frame:
    """A decoded gossip frame.

    Attributes
    ----------
    kind : FrameKind
        What the frame carries.
    sender : int
        Node id of the sender.
    state : PeerState
        The sender's state at send time.
    tensors : dict[str, torch.Tensor]
        Named tensors (MODEL frames only; empty otherwise).
    link : LinkHeader or None
        Where a DELTA frame sits in its link (DELTA frames only).
    update : bytes
        The compressed update of a DELTA frame (empty otherwise; not yet decoded).
    """

    kind: FrameKind
    sender: int
    state: PeerState
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    link: LinkHeader | None = None
    update: bytes = b""


def peer_state_to_json(state: PeerState) -> dict[str, Any]:
    """Return a JSON-able dict for ``state``."""
    return {
        "node_id": int(state.node_id),
        "enabled": bool(state.enabled),
        "model_version": int(state.model_version),
        # 4 significant digits: the estimates are EWMAs, and they ride on every frame.
        "est_comm_time_s": {
            str(int(k)): float(f"{float(v):.4g}") for k, v in state.est_comm_time_s.items()
        },
        "steps_per_s": float(state.steps_per_s),
    }


def peer_state_from_json(obj: object) -> PeerState:
    """Build a :class:`PeerState` from :func:`peer_state_to_json` output.

    Raises
    ------
    WireError
        If a field is missing or has the wrong type.
    """
    if not isinstance(obj, dict):
        raise WireError(f"peer state must be an object, got {type(obj).__name__}")
    node_id, enabled, version = obj.get("node_id"), obj.get("enabled"), obj.get("model_version")
    estimates = obj.get("est_comm_time_s", {})
    speed = obj.get("steps_per_s", 0.0)
    if not _is_int(node_id) or node_id < 0:
        raise WireError(f"peer state node_id must be a non-negative int, got {node_id!r}")
    if not isinstance(enabled, bool):
        raise WireError(f"peer state enabled must be a bool, got {enabled!r}")
    if not _is_int(version) or version < 0:
        raise WireError(f"peer state model_version must be a non-negative int, got {version!r}")
    if not isinstance(estimates, dict):
        raise WireError("peer state est_comm_time_s must be an object")
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed >= 0:
        raise WireError(f"peer state steps_per_s must be a number >= 0, got {speed!r}")
    parsed: dict[int, float] = {}
    for key, value in estimates.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise WireError(f"peer state estimate key must be a node id, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise WireError(f"peer state estimate for {key} must be a number >= 0, got {value!r}")
        parsed[int(key)] = float(value)
    return PeerState(
        node_id=node_id,
        enabled=enabled,
        model_version=version,
        est_comm_time_s=parsed,
        steps_per_s=float(speed),
    )


def encode_frame(
    kind: FrameKind,
    sender: int,
    state: PeerState,
    tensors: Mapping[str, torch.Tensor] | None = None,
    *,
    link: LinkHeader | None = None,
    update: bytes = b"",
) -> bytes:
    """Serialise one frame.

    Parameters
    ----------
    kind : FrameKind
        Frame kind; only MODEL frames may carry tensors, only DELTA frames a link
        header and an update.
    sender : int
        Sender node id.
    state : PeerState
        Sender's current state.
    tensors : Mapping[str, torch.Tensor], optional
        Named tensors for a MODEL frame.
    link : LinkHeader, optional
        The link header of a DELTA frame (required for DELTA).
    update : bytes
        The :func:`~fedddl.compression.encode_update` message of a DELTA frame.

    Returns
    -------
    bytes
        The frame, ready to send.
    """
    tensors = tensors or {}
    if kind is not FrameKind.MODEL and tensors:
        raise ValueError(f"only MODEL frames carry tensors, got {len(tensors)} for {kind.name}")
    if (kind is FrameKind.DELTA) != (link is not None) or (update and link is None):
        raise ValueError("a DELTA frame needs a link header and an update; others have neither")
    specs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, tensor in tensors.items():
        dtype_name = _DTYPE_NAMES.get(tensor.dtype)
        if dtype_name is None:
            raise ValueError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        array = tensor.detach().cpu().contiguous().numpy()
        specs.append({"name": name, "dtype": dtype_name, "shape": list(array.shape)})
        chunks.append(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    fields: dict[str, Any] = {
        "sender": int(sender), "state": peer_state_to_json(state), "tensors": specs
    }
    if link is not None:
        fields["link"] = {
            "base": link.base, "seq": link.seq, "key": link.key, "gains": list(link.gains)
        }
        chunks = [bytes(update)]
    header = json.dumps(fields, separators=(",", ":")).encode()
    payload = b"".join(chunks)
    crc = crc32_of((header, payload))
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, int(kind), 0, len(header), len(payload), crc)
    return prefix + header + payload


def decode_frame(
    data: bytes,
    max_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
    max_values: int | None = None,
) -> Frame:
    """Parse and fully validate one frame.

    Parameters
    ----------
    data : bytes
        The received bytes.
    max_bytes : int
        Largest frame accepted.
    max_header_bytes : int
        Largest JSON header accepted (checked before it is read).
    max_tensors : int
        Most tensors a MODEL frame may declare (checked before any tensor is built;
        :func:`~fedddl.compression.decode_update`'s default).
    max_values : int | None
        Most values in all a MODEL frame may declare (checked likewise); None: no limit
        besides ``max_bytes`` (a value takes at least one byte of the payload, and the
        tensors built are copies of the payload).

    Returns
    -------
    Frame
        The decoded frame; tensors are fresh copies (safe to keep).

    Raises
    ------
    WireError
        With the reason, if the frame is oversized, truncated, has a bad magic,
        version, kind or checksum, or an inconsistent header.
    """
    if len(data) > max_bytes:
        raise WireError(f"frame of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    if len(data) < _PREFIX.size:
        raise WireError(
            f"frame truncated: {len(data)} bytes, the fixed prefix needs {_PREFIX.size}"
        )
    magic, version, kind_value, reserved, header_len, payload_len, crc = _PREFIX.unpack_from(data)
    check_magic(
        "gossip frame",
        magic,
        version,
        expected_magic=MAGIC,
        expected_version=FORMAT_VERSION,
        error=WireError,
    )
    if kind_value not in {k.value for k in FrameKind}:
        raise WireError(f"unknown frame kind {kind_value}")
    if reserved != 0:
        raise WireError(f"reserved field must be 0, got {reserved}")
    if header_len > max_header_bytes:
        raise WireError(
            f"header of {header_len} bytes exceeds the limit max_header_bytes="
            f"{max_header_bytes} (pass a larger max_header_bytes= to accept more)"
        )
    expected = _PREFIX.size + header_len + payload_len
    if len(data) != expected:
        raise WireError(
            f"frame length {len(data)} does not match its header ({expected} bytes expected)"
        )
    body = memoryview(data)[_PREFIX.size :]
    check_crc("gossip frame", body, crc, error=WireError)
    header = _parse_header(bytes(body[:header_len]))
    kind = FrameKind(kind_value)
    state = peer_state_from_json(header["state"])
    if state.node_id != header["sender"]:
        raise WireError(f"sender {header['sender']} does not match its state's id {state.node_id}")
    if kind is FrameKind.DELTA:
        if header["tensors"]:
            raise WireError("DELTA frame must not carry raw tensors")
        link = _parse_link(header.get("link"))
        update = bytes(body[header_len:])
        return Frame(kind=kind, sender=header["sender"], state=state, link=link, update=update)
    if "link" in header:
        raise WireError(f"{kind.name} frame must not carry a link header")
    _check_counts(header["tensors"], max_tensors, max_values)
    tensors = _parse_tensors(header["tensors"], body[header_len:], payload_len)
    if kind is not FrameKind.MODEL and tensors:
        raise WireError(f"{kind.name} frame must not carry tensors")
    return Frame(kind=kind, sender=header["sender"], state=state, tensors=tensors)


def _parse_link(obj: object) -> LinkHeader:
    if not isinstance(obj, dict):
        raise WireError("DELTA frame lacks its link header object")
    base, seq, key, gains = obj.get("base"), obj.get("seq"), obj.get("key"), obj.get("gains")
    if not isinstance(base, str) or not _is_int(seq) or not isinstance(key, bool):
        raise WireError(f"link header needs base (str), seq (int), key (bool), got {obj!r}")
    if not isinstance(gains, list) or not all(
        isinstance(g, (int, float)) and not isinstance(g, bool) for g in gains
    ):
        raise WireError("link header gains must be a list of numbers")
    try:
        return LinkHeader(base, seq, key, tuple(float(g) for g in gains))
    except ValueError as exc:
        raise WireError(f"bad link header: {exc}") from None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header must be a JSON object")
    sender = header.get("sender")
    if not _is_int(sender) or sender < 0:
        raise WireError(f"header sender must be a non-negative int, got {sender!r}")
    if not isinstance(header.get("tensors"), list):
        raise WireError("header tensors must be a list")
    if "state" not in header:
        raise WireError("header lacks the sender's state")
    return header


def _check_counts(specs: list[Any], max_tensors: int, max_values: int | None) -> None:
    """Refuse more than ``max_tensors`` specs or ``max_values`` values, before any is built."""
    if len(specs) > max_tensors:
        raise WireError(
            f"frame declares {len(specs)} tensors, more than the limit max_tensors="
            f"{max_tensors} (pass a larger max_tensors= to accept more)"
        )
    if max_values is None:
        return
    values = 0
    for spec in specs:
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape):
            values += math.prod(shape)  # malformed specs are refused by _parse_tensors
    if values > max_values:
        raise WireError(
            f"frame declares {values} values, more than the limit max_values={max_values} "
            "(pass a larger max_values= to accept more)"
        )


def _parse_tensors(
    specs: list[Any], payload: memoryview, payload_len: int
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for index, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise WireError(f"tensor spec {index} must be an object")
        name, dtype_name, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
        if not isinstance(name, str) or not name:
            raise WireError(f"tensor spec {index} has no valid name")
        if name in tensors:
            raise WireError(f"tensor {name!r} appears twice")
        if dtype_name not in _DTYPES:
            raise WireError(f"tensor {name!r} has unsupported dtype {dtype_name!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise WireError(f"tensor {name!r} shape must be a list of ints >= 0, got {shape!r}")
        np_dtype = np.dtype(dtype_name).newbyteorder("<")
        nbytes = math.prod(shape) * np_dtype.itemsize
        if offset + nbytes > payload_len:
            raise WireError(f"tensor {name!r} runs past the end of the payload")
        array = np.frombuffer(payload[offset : offset + nbytes], dtype=np_dtype).reshape(shape)
        tensors[name] = torch.from_numpy(array.astype(np_dtype.newbyteorder("="), copy=True))
        offset += nbytes
    if offset != payload_len:
        raise WireError(f"payload has {payload_len - offset} bytes not described by the header")
    return tensors
