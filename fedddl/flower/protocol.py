"""The localized-replica protocol in Flower messages: every record and key, once.

Both sides import this module (``strategies/`` to build instructions and parse replies,
``clients/`` to parse instructions and build replies); neither imports the other. A TRAIN
message carries the records :data:`CONFIG` (with ``model-version``), and optionally
:data:`UPDATES`, :data:`SNAPSHOT`, :data:`SCALES`; a reply :data:`UPDATE`,
:data:`METRICS` and :data:`REPLICA` (a client that cannot catch up: ``METRICS`` only,
with ``resync = 1``). The values are the Flower-free
:class:`~fedddl.sync.messages.TrainInstruction` and
:class:`~fedddl.sync.messages.ClientReply`. A TRAIN message with an ``"arrays"`` record
instead is stock FedAvg (:data:`FEDAVG_ARRAYS`). :func:`parse_reply` refuses a reply
with any metric out of range (:class:`~fedddl.sync.errors.ReplyError`). Every record and
key in full: docs/terngrad.md.
"""

from __future__ import annotations

import math

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedddl.flower.records import (
    array_to_bytes,
    array_to_floats,
    bytes_to_array,
    floats_to_array,
    record_of,
    record_to_tensors,
    tensors_to_record,
)
from fedddl.sync.errors import ReplyError
from fedddl.sync.messages import (
    FINGERPRINT_BYTES,
    ClientReply,
    TrainInstruction,
)

__all__ = [
    "CONFIG",
    "FEDAVG_ARRAYS",
    "MAX_EXAMPLES",
    "MAX_LOSS",
    "METRICS",
    "REPLICA",
    "SCALES",
    "SNAPSHOT",
    "UPDATE",
    "UPDATES",
    "build_reply_content",
    "build_train_content",
    "is_localized_train",
    "parse_reply",
    "parse_train_content",
]

# Records of a TRAIN message.
CONFIG = "config"
UPDATES = "updates"
SNAPSHOT = "snapshot"
SCALES = "scales"
# Records of a reply.
UPDATE = "update"
METRICS = "metrics"
REPLICA = "replica"
# Arrays and keys.
PAYLOAD = "payload"
STATISTICS = "statistics"
SCALES_ARRAY = "s"
SERVER_ROUND = "server-round"
MODEL_VERSION = "model-version"
COMPRESSOR = "compressor"
SNAPSHOT_VERSION = "snapshot-version"
WANT_SCALES = "want-scales"
NUM_EXAMPLES = "num-examples"
LOSS = "loss"
PARTITION_ID = "partition-id"
RESYNC = "resync"
FINGERPRINT = "fingerprint"
CLIENT_SECONDS = "client-s"
CLIENT_CACHED = "client-cached"
#: The record of a stock FedAvg TRAIN message and reply (model weights).
FEDAVG_ARRAYS = "arrays"
#: Default bound on a reply's ``num-examples`` (a server passes its own, e.g. batch x steps).
MAX_EXAMPLES = (1 << 31) - 1
#: Largest ``loss`` a reply may report (a cross-entropy beyond it means a diverged replica).
MAX_LOSS = 1e9
#: Largest ``partition-id`` a reply may report.
MAX_PARTITION_ID = (1 << 31) - 1


def is_localized_train(content: RecordDict) -> bool:
    """Whether a TRAIN message belongs to this protocol (else it may be FedAvg)."""
    config = record_of(content, CONFIG, ConfigRecord)
    return config is not None and MODEL_VERSION in config


# ------------------------------------------------------------ server → client
def build_train_content(instruction: TrainInstruction) -> RecordDict:
    """The :class:`~flwr.app.RecordDict` of a training message (layout: docs/terngrad.md)."""
    config = ConfigRecord(
        {SERVER_ROUND: instruction.server_round, MODEL_VERSION: instruction.model_version}
    )
    if instruction.compressor is not None:
        config[COMPRESSOR] = instruction.compressor
    if instruction.want_scales:
        config[WANT_SCALES] = 1
    records: dict[str, ArrayRecord | MetricRecord | ConfigRecord] = {CONFIG: config}
    if instruction.updates:
        records[UPDATES] = ArrayRecord(
            {f"v{v}": bytes_to_array(p) for v, p in instruction.updates}
        )
    if instruction.snapshot is not None:
        config[SNAPSHOT_VERSION] = instruction.snapshot_version
        records[SNAPSHOT] = tensors_to_record(instruction.snapshot)
    if instruction.scales is not None:
        records[SCALES] = ArrayRecord({SCALES_ARRAY: floats_to_array(instruction.scales)})
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
    config = record_of(content, CONFIG, ConfigRecord)
    if config is None:
        raise ReplyError(f"train message has no {CONFIG!r} ConfigRecord")
    server_round = _int(config, SERVER_ROUND, "train message")
    model_version = _int(config, MODEL_VERSION, "train message")
    updates: list[tuple[int, bytes]] = []
    upd = record_of(content, UPDATES, ArrayRecord)
    if upd is not None:
        for key, arr in upd.items():
            if not key.startswith("v") or not key[1:].lstrip("-").isdigit():
                raise ReplyError(f"train message: bad update key {key!r}")
            updates.append((int(key[1:]), array_to_bytes(arr)))
        updates.sort(key=lambda item: item[0])
    snapshot = None
    snapshot_version = -1
    snap = record_of(content, SNAPSHOT, ArrayRecord)
    if snap is not None:
        snapshot_version = _int(config, SNAPSHOT_VERSION, "train message")
        snapshot = record_to_tensors(snap)
    compressor = config.get(COMPRESSOR)
    if compressor is not None and not isinstance(compressor, str):
        raise ReplyError(f"train message: {COMPRESSOR!r} must be a str, got {compressor!r}")
    scales = None
    sc = record_of(content, SCALES, ArrayRecord)
    if sc is not None:
        if SCALES_ARRAY not in sc:
            raise ReplyError(f"train message: {SCALES!r} ArrayRecord lacks {SCALES_ARRAY!r}")
        scales = array_to_floats(sc[SCALES_ARRAY])
    return TrainInstruction(
        server_round,
        model_version,
        updates,
        snapshot,
        snapshot_version,
        compressor,
        scales,
        want_scales=config.get(WANT_SCALES) == 1,
    )


# ------------------------------------------------------------ client → server
def build_reply_content(reply: ClientReply) -> RecordDict:
    """The :class:`~flwr.app.RecordDict` of a client's reply (a gradient or a resync)."""
    if reply.payload is None:
        return RecordDict(
            {
                METRICS: MetricRecord(
                    {NUM_EXAMPLES: 0, MODEL_VERSION: reply.model_version, RESYNC: 1}
                ),
            }
        )
    arrays = {PAYLOAD: bytes_to_array(reply.payload)}
    if reply.scales is not None:
        arrays[SCALES] = floats_to_array(reply.scales)
    if reply.statistics is not None:
        arrays[STATISTICS] = bytes_to_array(reply.statistics)
    return RecordDict(
        {
            UPDATE: ArrayRecord(arrays),
            METRICS: MetricRecord(
                {
                    NUM_EXAMPLES: reply.num_examples,
                    LOSS: float(reply.loss),
                    MODEL_VERSION: reply.model_version,
                    **({} if reply.partition_id is None else {PARTITION_ID: reply.partition_id}),
                }
            ),
            REPLICA: ConfigRecord({FINGERPRINT: bytes.fromhex(reply.fingerprint)}),
        }
    )


def parse_reply(message: Message, *, max_examples: int = MAX_EXAMPLES) -> ClientReply:
    """Validate and parse one training reply.

    Parameters
    ----------
    message : Message
        The reply.
    max_examples : int
        Largest acceptable ``num-examples``.

    Raises
    ------
    ReplyError
        If the message carries an error, records are missing or malformed, or a metric is
        out of range (the bounds: docs/terngrad.md).
    """
    node_id = int(message.metadata.src_node_id)
    if message.has_error():
        raise ReplyError(f"node {node_id} replied with error: {message.error.reason}")
    content = message.content
    metrics = record_of(content, METRICS, MetricRecord)
    if metrics is None:
        raise ReplyError(f"node {node_id}: reply has no {METRICS!r} MetricRecord")
    what = f"node {node_id} reply"
    version = _int(metrics, MODEL_VERSION, what)
    if version < -1:
        raise ReplyError(f"{what}: {MODEL_VERSION} must be >= -1, got {version}")
    seconds = metrics.get(CLIENT_SECONDS)
    if seconds is not None and not (isinstance(seconds, float) and 0 <= seconds < math.inf):
        raise ReplyError(f"{what}: {CLIENT_SECONDS!r} must be a finite float >= 0")
    resync = metrics.get(RESYNC)
    if resync is not None and resync != 1:
        raise ReplyError(f"{what}: {RESYNC!r} must be 1 when present, got {resync!r}")
    if resync == 1:
        return ClientReply.resync_request(node_id, version)
    num_examples = _int(metrics, NUM_EXAMPLES, what)
    if not 1 <= num_examples <= max_examples:
        raise ReplyError(
            f"{what}: {NUM_EXAMPLES} must be in [1, {max_examples}], got {num_examples}"
        )
    loss = metrics.get(LOSS)
    if isinstance(loss, bool) or not isinstance(loss, int | float):
        raise ReplyError(f"{what}: {LOSS!r} must be a number, got {loss!r}")
    if not 0 <= loss <= MAX_LOSS:  # also false for NaN
        raise ReplyError(f"{what}: {LOSS!r} must be finite and in [0, {MAX_LOSS:g}], got {loss}")
    partition_id = None
    if PARTITION_ID in metrics:
        partition_id = _int(metrics, PARTITION_ID, what)
        if not 0 <= partition_id <= MAX_PARTITION_ID:
            raise ReplyError(
                f"{what}: {PARTITION_ID!r} must be in [0, {MAX_PARTITION_ID}], got {partition_id}"
            )
    replica = record_of(content, REPLICA, ConfigRecord)
    raw_fp = None if replica is None else replica.get(FINGERPRINT)
    if not isinstance(raw_fp, bytes) or len(raw_fp) != FINGERPRINT_BYTES:
        raise ReplyError(
            f"{what}: missing {REPLICA!r} ConfigRecord with a {FINGERPRINT_BYTES}-byte "
            f"{FINGERPRINT!r}"
        )
    update = record_of(content, UPDATE, ArrayRecord)
    if update is None or PAYLOAD not in update:
        raise ReplyError(f"{what}: missing {UPDATE!r} ArrayRecord with a {PAYLOAD!r} Array")
    try:
        payload = array_to_bytes(update[PAYLOAD])
    except ValueError as err:
        raise ReplyError(f"{what}: bad payload Array: {err}") from err
    scales = None
    if SCALES in update:
        try:
            scales = array_to_floats(update[SCALES])
        except ValueError as err:
            raise ReplyError(f"{what}: bad {SCALES!r} Array: {err}") from err
        if scales.ndim != 1 or not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ReplyError(f"{what}: {SCALES!r} must be a 1-D finite non-negative float array")
    statistics = None
    if STATISTICS in update:
        try:
            statistics = array_to_bytes(update[STATISTICS])
        except ValueError as err:
            raise ReplyError(f"{what}: bad {STATISTICS!r} Array: {err}") from err
    return ClientReply(
        node_id, version, raw_fp.hex(), payload, num_examples, float(loss), scales, statistics,
        partition_id,
    )
