"""Pure helpers of the localized-model protocol: message layout, records, byte counts.

Message layout (one message per client per round)
--------------------------------------------------
Server → client, ``MessageType.TRAIN``:

* ``"config"`` :class:`~flwr.app.ConfigRecord`: ``server-round``, ``model-version``
  (the version the client must hold before computing), optional ``compressor``
  (uplink compressor name, sent when the server has no proof the client knows it),
  optional ``snapshot-version``, optional ``shared-scales`` marker.
* ``"updates"`` :class:`~flwr.app.ArrayRecord` (optional): ``"v<k>"`` → encoded update
  producing version ``k`` (raw bytes in a ``uint8`` :class:`~flwr.app.Array`), oldest first.
* ``"snapshot"`` :class:`~flwr.app.ArrayRecord` (optional): weights and momentum
  buffers of the shadow replica at ``snapshot-version`` (:meth:`fedddl.replica.Replica.snapshot`).
* ``"scales"`` :class:`~flwr.app.ArrayRecord` (optional): shared per-tensor ternary
  scales (``float32``), for ``downlink = "shared-scale-sum"``.

Client → server reply:

* ``"update"`` :class:`~flwr.app.ArrayRecord`: ``"payload"`` → encoded (pseudo-)gradient,
  optionally ``"scales"`` → the client's local per-tensor scales (``float32``).
* ``"metrics"`` :class:`~flwr.app.MetricRecord`: ``num-examples``, ``loss``, ``model-version``.
* ``"replica"`` :class:`~flwr.app.ConfigRecord`: ``fingerprint`` (first 16 bytes of the
  sha256 :func:`fedddl.training.parameters_fingerprint`) of the replica
  the gradient was computed on. A client that cannot catch up sends ``model-version``
  (its version, -1 without state) and ``resync = 1`` and no ``"update"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from fedddl.compression import Compressor

__all__ = [
    "BYTES_STYPE",
    "ClientReply",
    "ReplyError",
    "TrainInstruction",
    "array_to_bytes",
    "array_to_floats",
    "build_reply_content",
    "build_resync_content",
    "build_train_content",
    "bytes_to_array",
    "content_nbytes",
    "derive_seed",
    "fingerprint_prefix",
    "floats_to_array",
    "make_compressor",
    "mean_updates",
    "pack_tensors",
    "parse_reply",
    "parse_train_content",
    "record_to_tensors",
    "tensors_to_record",
    "unpack_tensors",
]

BYTES_STYPE = "bytes"
CONFIG_KEY = "config"
UPDATES_KEY = "updates"
SNAPSHOT_KEY = "snapshot"
SCALES_KEY = "scales"
REPLY_UPDATE_KEY = "update"
REPLY_METRICS_KEY = "metrics"
REPLY_REPLICA_KEY = "replica"
PAYLOAD_KEY = "payload"


#: Bytes of the sha256 fingerprint a client reports (a 128-bit prefix keeps replies small).
FINGERPRINT_BYTES = 16


def fingerprint_prefix(fingerprint_hex: str) -> bytes:
    """The first :data:`FINGERPRINT_BYTES` bytes of a hex sha256 fingerprint."""
    raw = bytes.fromhex(fingerprint_hex)
    if len(raw) < FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must have >= {FINGERPRINT_BYTES} bytes, got {len(raw)}")
    return raw[:FINGERPRINT_BYTES]


class ReplyError(ValueError):
    """A client reply is malformed (missing records, wrong types, bad values)."""


# ------------------------------------------------------------------ raw bytes
def bytes_to_array(data: bytes) -> Array:
    """Wrap raw bytes as a 1-D ``uint8`` :class:`~flwr.app.Array` without a numpy header."""
    return Array(dtype="uint8", shape=(len(data),), stype=BYTES_STYPE, data=bytes(data))


def array_to_bytes(array: Array) -> bytes:
    """Return the raw bytes of a :func:`bytes_to_array` (or 1-D numpy ``uint8``) Array.

    Raises
    ------
    ValueError
        If the array is not 1-D ``uint8``.
    """
    if not isinstance(array, Array):
        raise ValueError(f"expected a flwr Array, got {type(array).__name__}")
    if array.dtype != "uint8" or len(array.shape) != 1:
        raise ValueError(f"expected a 1-D uint8 Array, got {array.dtype} {tuple(array.shape)}")
    if array.stype == BYTES_STYPE:
        if len(array.data) != array.shape[0]:
            raise ValueError(f"byte Array says {array.shape[0]} bytes but holds {len(array.data)}")
        return bytes(array.data)
    return bytes(np.ascontiguousarray(array.numpy(), dtype=np.uint8).tobytes())


def floats_to_array(values: torch.Tensor) -> Array:
    """Raw little-endian ``float32`` bytes of a 1-D tensor, as a byte Array (no numpy header)."""
    flat = values.detach().reshape(-1).to(torch.float32).contiguous()
    return bytes_to_array(flat.numpy().astype("<f4").tobytes())


def array_to_floats(array: Array) -> torch.Tensor:
    """Inverse of :func:`floats_to_array`.

    Raises
    ------
    ValueError
        If the byte length is not a multiple of 4.
    """
    raw = array_to_bytes(array)
    if len(raw) % 4:
        raise ValueError(f"float32 array has {len(raw)} bytes, not a multiple of 4")
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32))


RAW_STYPE = "fedddl.raw"


def tensors_to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Convert named tensors to an :class:`~flwr.app.ArrayRecord` (order kept).

    Each tensor becomes an :class:`~flwr.app.Array` holding its raw little-endian bytes
    (``stype = "fedddl.raw"``, ``dtype`` the torch dtype name without ``torch.``): no
    numpy header and no ``np.save``/``np.load`` round trip.
    """
    out: dict[str, Array] = {}
    for k, v in tensors.items():
        t = v.detach().cpu().contiguous()
        flat = t.reshape(-1)
        raw = flat.view(torch.uint8) if t.dtype != torch.bool else flat.to(torch.uint8)
        data = raw.numpy().tobytes() if t.numel() else b""
        out[k] = Array(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=tuple(t.shape),
            stype=RAW_STYPE,
            data=data,
        )
    return ArrayRecord(out)  # type: ignore[arg-type]


def record_to_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Convert an :class:`~flwr.app.ArrayRecord` (raw or numpy Arrays) back to tensors.

    Raises
    ------
    ValueError
        If an Array's dtype is unknown or its byte length does not match its shape.
    """
    out: dict[str, torch.Tensor] = {}
    for k, a in record.items():
        if a.stype != RAW_STYPE:
            out[k] = torch.from_numpy(np.array(a.numpy(), copy=True))
            continue
        dtype = getattr(torch, a.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"array {k!r}: unknown dtype {a.dtype!r}")
        shape = tuple(int(d) for d in a.shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if len(a.data) != math.prod(shape) * itemsize:
            raise ValueError(f"array {k!r}: {len(a.data)} bytes do not fit {shape} {a.dtype}")
        if not a.data:
            out[k] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(bytearray(a.data), dtype=torch.uint8)
        out[k] = (flat.to(torch.bool) if dtype == torch.bool else flat.view(dtype)).reshape(shape)
    return out


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[Array, ConfigRecord]:
    """Pack named tensors into one raw byte :class:`~flwr.app.Array` plus its layout.

    One Array instead of one per tensor makes ``context.state`` writes cheap. The
    layout :class:`~flwr.app.ConfigRecord` holds ``names``, ``dtypes``, ``ndims`` and
    the flattened ``shapes``.
    """
    names: list[str] = []
    dtypes: list[str] = []
    ndims: list[int] = []
    shapes: list[int] = []
    parts: list[np.ndarray] = []
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        ndims.append(tensor.dim())
        shapes.extend(int(d) for d in tensor.shape)
        if t.numel():
            parts.append(
                (t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).numpy()
            )
    blob = np.concatenate(parts).tobytes() if parts else b""
    layout = ConfigRecord({"names": names, "dtypes": dtypes, "ndims": ndims, "shapes": shapes})
    return bytes_to_array(blob), layout


def unpack_tensors(array: Array, layout: ConfigRecord) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_tensors` (tensors own their memory).

    Raises
    ------
    ValueError
        If the layout is malformed or does not match the byte count.
    """
    names, dtypes = layout.get("names", []), layout.get("dtypes", [])
    ndims, shapes = layout.get("ndims", []), layout.get("shapes", [])
    if not (
        isinstance(names, list)
        and isinstance(dtypes, list)
        and isinstance(ndims, list)
        and isinstance(shapes, list)
        and len(names) == len(dtypes) == len(ndims)
    ):
        raise ValueError("tensor layout is malformed")
    blob = bytearray(array_to_bytes(array))
    flat = torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    offset = pos = 0
    for name, dname, nd in zip(names, dtypes, ndims, strict=True):
        dtype = getattr(torch, str(dname), None)
        if not isinstance(dtype, torch.dtype) or not isinstance(nd, int):
            raise ValueError(f"tensor layout: bad dtype/ndim for {name!r}")
        shape = tuple(int(d) for d in shapes[pos : pos + nd])
        pos += nd
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if offset + size > flat.numel():
            raise ValueError(f"tensor layout: {name!r} runs past the {flat.numel()} bytes")
        chunk = flat[offset : offset + size]
        offset += size
        value = chunk.to(torch.bool) if dtype == torch.bool else chunk.clone().view(dtype)
        out[str(name)] = value.reshape(shape)
    if offset != flat.numel() or pos != len(shapes):
        raise ValueError("tensor layout does not account for every byte")
    return out


def content_nbytes(content: RecordDict) -> int:
    """Bytes of ``content`` serialized as Flower's protobuf ``RecordDict``."""
    return int(recorddict_to_proto(content).ByteSize())


# --------------------------------------------------------------- instructions
@dataclass(frozen=True)
class TrainInstruction:
    """What one server message asks of a client.

    Attributes
    ----------
    server_round : int
        Current round.
    model_version : int
        Version the client must hold before computing its gradient.
    updates : list[tuple[int, bytes]]
        ``(version, encoded update)`` to apply, oldest first.
    snapshot : dict[str, torch.Tensor] | None
        Replica snapshot to load first, with ``snapshot_version``.
    snapshot_version : int
        Version of ``snapshot`` (-1 without one).
    compressor : str | None
        Uplink compressor name, when sent.
    scales : torch.Tensor | None
        Shared per-tensor ternary scales (``float32``), in parameter order.
    want_scales : bool
        Whether the reply must carry the client's local per-tensor scales.
    """

    server_round: int
    model_version: int
    updates: list[tuple[int, bytes]]
    snapshot: dict[str, torch.Tensor] | None = None
    snapshot_version: int = -1
    compressor: str | None = None
    scales: torch.Tensor | None = None
    want_scales: bool = False


def build_train_content(instruction: TrainInstruction) -> RecordDict:
    """Build the :class:`~flwr.app.RecordDict` of a training message (see module docstring)."""
    config = ConfigRecord(
        {"server-round": instruction.server_round, "model-version": instruction.model_version}
    )
    if instruction.compressor is not None:
        config["compressor"] = instruction.compressor
    if instruction.want_scales:
        config["want-scales"] = 1
    records: dict[str, ArrayRecord | MetricRecord | ConfigRecord] = {CONFIG_KEY: config}
    if instruction.updates:
        records[UPDATES_KEY] = ArrayRecord(
            {f"v{v}": bytes_to_array(p) for v, p in instruction.updates}
        )
    if instruction.snapshot is not None:
        config["snapshot-version"] = instruction.snapshot_version
        records[SNAPSHOT_KEY] = tensors_to_record(instruction.snapshot)
    if instruction.scales is not None:
        records[SCALES_KEY] = ArrayRecord({"s": floats_to_array(instruction.scales)})
    return RecordDict(records)


def _int(record: ConfigRecord | MetricRecord, key: str, what: str) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReplyError(f"{what}: {key!r} must be an int, got {value!r}")
    return value


def parse_train_content(content: RecordDict) -> TrainInstruction:
    """Parse a training message built by :func:`build_train_content`.

    Raises
    ------
    ReplyError
        If a record is missing or malformed (names what is wrong).
    """
    config = content.config_records.get(CONFIG_KEY)
    if config is None:
        raise ReplyError("train message has no 'config' ConfigRecord")
    server_round = _int(config, "server-round", "train message")
    model_version = _int(config, "model-version", "train message")
    updates: list[tuple[int, bytes]] = []
    upd = content.array_records.get(UPDATES_KEY)
    if upd is not None:
        for key, arr in upd.items():
            if not key.startswith("v") or not key[1:].lstrip("-").isdigit():
                raise ReplyError(f"train message: bad update key {key!r}")
            updates.append((int(key[1:]), array_to_bytes(arr)))
        updates.sort(key=lambda item: item[0])
    snapshot = None
    snapshot_version = -1
    snap = content.array_records.get(SNAPSHOT_KEY)
    if snap is not None:
        snapshot_version = _int(config, "snapshot-version", "train message")
        snapshot = record_to_tensors(snap)
    compressor = config.get("compressor")
    if compressor is not None and not isinstance(compressor, str):
        raise ReplyError(f"train message: 'compressor' must be a str, got {compressor!r}")
    scales = None
    sc = content.array_records.get(SCALES_KEY)
    if sc is not None:
        if "s" not in sc:
            raise ReplyError("train message: 'scales' ArrayRecord lacks 's'")
        scales = array_to_floats(sc["s"])
    return TrainInstruction(
        server_round,
        model_version,
        updates,
        snapshot,
        snapshot_version,
        compressor,
        scales,
        want_scales=config.get("want-scales") == 1,
    )


# -------------------------------------------------------------------- replies
@dataclass(frozen=True)
class ClientReply:
    """A parsed client reply.

    Attributes
    ----------
    node_id : int
        Sender.
    model_version : int
        Version of the client's replica (-1: no state).
    fingerprint : str
        Hex of the first :data:`FINGERPRINT_BYTES` bytes of the replica's fingerprint
        ('' on resync).
    payload : bytes | None
        Encoded gradient; None when the client asks to resync.
    num_examples : int
        Examples used.
    loss : float
        Mean training loss over the local steps.
    scales : torch.Tensor | None
        The client's local per-tensor scales (shared-scale downlink only).
    """

    node_id: int
    model_version: int
    fingerprint: str
    payload: bytes | None
    num_examples: int
    loss: float
    scales: torch.Tensor | None = None

    @property
    def resync(self) -> bool:
        """Whether the client could not catch up and sent no gradient."""
        return self.payload is None


def build_reply_content(
    payload: bytes,
    *,
    fingerprint: str,
    model_version: int,
    num_examples: int,
    loss: float,
    scales: torch.Tensor | None = None,
) -> RecordDict:
    """Build the reply :class:`~flwr.app.RecordDict` of a client that computed a gradient."""
    arrays = {PAYLOAD_KEY: bytes_to_array(payload)}
    if scales is not None:
        arrays[SCALES_KEY] = floats_to_array(scales)
    return RecordDict(
        {
            REPLY_UPDATE_KEY: ArrayRecord(arrays),
            REPLY_METRICS_KEY: MetricRecord(
                {"num-examples": num_examples, "loss": float(loss), "model-version": model_version}
            ),
            REPLY_REPLICA_KEY: ConfigRecord({"fingerprint": fingerprint_prefix(fingerprint)}),
        }
    )


def build_resync_content(model_version: int) -> RecordDict:
    """Build the reply of a client that cannot reach the requested version."""
    return RecordDict(
        {
            REPLY_METRICS_KEY: MetricRecord(
                {"num-examples": 0, "model-version": model_version, "resync": 1}
            ),
        }
    )


def parse_reply(message: Message) -> ClientReply:
    """Validate and parse one training reply.

    Raises
    ------
    ReplyError
        If the message carries an error, or records are missing or malformed.
    """
    node_id = int(message.metadata.src_node_id)
    if message.has_error():
        raise ReplyError(f"node {node_id} replied with error: {message.error.reason}")
    content = message.content
    metrics = content.metric_records.get(REPLY_METRICS_KEY)
    if metrics is None:
        raise ReplyError(f"node {node_id}: reply has no 'metrics' MetricRecord")
    what = f"node {node_id} reply"
    version = _int(metrics, "model-version", what)
    if metrics.get("resync") == 1:
        return ClientReply(node_id, version, "", None, 0, math.nan)
    num_examples = _int(metrics, "num-examples", what)
    if num_examples < 1:
        raise ReplyError(f"{what}: num-examples must be >= 1, got {num_examples}")
    loss = metrics.get("loss")
    if isinstance(loss, bool) or not isinstance(loss, int | float):
        raise ReplyError(f"{what}: 'loss' must be a number, got {loss!r}")
    replica = content.config_records.get(REPLY_REPLICA_KEY)
    raw_fp = None if replica is None else replica.get("fingerprint")
    if not isinstance(raw_fp, bytes) or len(raw_fp) != FINGERPRINT_BYTES:
        raise ReplyError(
            f"{what}: missing 'replica' ConfigRecord with a {FINGERPRINT_BYTES}-byte 'fingerprint'"
        )
    fingerprint = raw_fp.hex()
    update = content.array_records.get(REPLY_UPDATE_KEY)
    if update is None or PAYLOAD_KEY not in update:
        raise ReplyError(f"{what}: missing 'update' ArrayRecord with a 'payload' Array")
    try:
        payload = array_to_bytes(update[PAYLOAD_KEY])
    except ValueError as err:
        raise ReplyError(f"{what}: bad payload Array: {err}") from err
    scales = None
    if SCALES_KEY in update:
        try:
            scales = array_to_floats(update[SCALES_KEY])
        except ValueError as err:
            raise ReplyError(f"{what}: bad 'scales' Array: {err}") from err
        if scales.ndim != 1 or not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ReplyError(f"{what}: 'scales' must be a 1-D finite non-negative float array")
    return ClientReply(node_id, version, fingerprint, payload, num_examples, float(loss), scales)


# ---------------------------------------------------------------- aggregation
def mean_updates(updates: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of decoded updates (same names and shapes), in float32.

    Raises
    ------
    ValueError
        If ``updates`` is empty or names differ.
    """
    if not updates:
        raise ValueError("mean_updates needs at least one update")
    names = list(updates[0])
    for u in updates[1:]:
        if set(u) != set(names):
            raise ValueError("updates have different tensor names")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        acc = torch.zeros_like(updates[0][name], dtype=torch.float32)
        for u in updates:
            acc += u[name].to(torch.float32)
        out[name] = acc / len(updates)
    return out


# ---------------------------------------------------------------- compressors
def make_compressor(name: str, *, clip_sigma: float, seed: int) -> Compressor:
    """Build a registered compressor by name.

    The built-in ternary compressors (``"ternary"``, ``"ternary-base3"``) get
    ``clip_sigma`` and ``seed``; any other registered name is built with its
    factory's defaults.

    Raises
    ------
    ValueError
        If ``name`` is not registered.
    """
    from fedddl.compression import available_compressors, get_compressor

    if name not in available_compressors():
        raise ValueError(
            f"unknown compressor {name!r}; registered: {', '.join(available_compressors())}"
        )
    if name.startswith("ternary"):
        return get_compressor(name, clip_sigma=clip_sigma, seed=seed)
    return get_compressor(name)


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (stable across processes)."""
    acc = 0x9E3779B97F4A7C15
    for p in parts:
        acc = (acc ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        acc ^= acc >> 31
    return acc & 0x7FFFFFFFFFFFFFFF
