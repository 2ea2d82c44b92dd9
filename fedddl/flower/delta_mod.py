"""``ternary_mod``: a Flower client mod that sends and receives ternary model deltas.

Add it to any ClientApp; the training code stays as it is::

    from fedddl.flower import ternary_mod

    app = ClientApp(mods=[ternary_mod])

and wrap the server's strategy in :class:`fedddl.flower.TernaryDelta`. On a message
that the wrapper compressed (:mod:`fedddl.flower.delta_protocol`), the mod

1. brings the broadcast model it keeps in ``context.state`` to the message's version
   (applying the ternary updates, taking the whole model, or, with the ``grid`` downlink,
   applying one count message: :mod:`fedddl.flower.delta_grid_mod`), checks its digest, and
   hands the app the message as the strategy built it, with the whole model;
2. encodes the app's reply model as ``reply - broadcast model`` with the ternary
   compressor the server names and error feedback when the server asks for it (the
   residual is kept in ``context.state``, and dropped once the server stops asking), when
   the reply carries an ArrayRecord shaped like the model.

A message without the wrapper's record, and a reply without such a model, pass through
unchanged. A reply model of another float dtype than the broadcast model (float64 from a
float32 model, float16, ...) is compressed all the same: its delta is computed and sent in
float32 and the server restores it in the dtype the app sent. Whenever a message or reply
that carries arrays travels uncompressed, the mod says why on Flower's logger, once per
node and reason (remembered in ``context.state``). When the broadcast cannot be applied
(wrong base version, digest mismatch, malformed update) the mod forgets its broadcast
model and answers with an error reply (``MOD_FAILED_PRECONDITION``) instead of calling
the app; the server then sends this node the whole model. Put ``ternary_mod`` first in
``mods`` so that other mods (e.g. Flower's clipping mods) see whole models.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from fedddl.compression import (
    ResidualMemory,
    TernaryCompressor,
    encode_update,
    make_compressor,
)
from fedddl.flower.delta_grid_mod import forget_grid, reach_grid, rebuild_grid, save_grid
from fedddl.flower.delta_grid_protocol import GRID, GRID_LAYOUT
from fedddl.flower.delta_protocol import (
    DELTA,
    DELTA_KEY,
    FLOAT_DTYPES,
    META,
    UPDATES,
    UPLINK_DTYPE,
    Broadcast,
    ReplyMeta,
    SplitModel,
    digest,
    join_model,
    parse_broadcast,
    split_model,
    update_key,
)
from fedddl.flower.records import (
    array_to_bytes,
    bytes_to_array,
    pack_tensors,
    save_residuals,
    saved_residuals,
    unpack_tensors,
)
from fedddl.seeding import derive_seed
from fedddl.sync.errors import PayloadRejected
from fedddl.sync.screening import PayloadSpec

__all__ = ["STATE_MODEL", "STATE_RESIDUAL", "STATE_SAID", "ternary_mod"]

_WARNING = logging.WARNING

#: ``context.state`` records of the mod: the broadcast model (packed) with its layout and
#: version, and the uplink residuals.
STATE_MODEL = "fedddl.ternary.model"
STATE_MODEL_LAYOUT = "fedddl.ternary.model-layout"
STATE_META = "fedddl.ternary.state"
STATE_RESIDUAL = "fedddl.ternary.residual"
#: ``context.state`` record of the reasons this node already logged for sending plain.
STATE_SAID = "fedddl.ternary.said"
_BLOB = "blob"


class BroadcastError(ValueError):
    """The broadcast cannot be applied to the model this client holds."""


def ternary_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Decode ternary model deltas on the way in, encode the reply's delta on the way out.

    See the module docstring; the server side is :class:`fedddl.flower.TernaryDelta`.
    """
    if msg.has_error() or not msg.has_content() or META not in msg.content:
        if not msg.has_error() and msg.has_content() and msg.content.array_records:
            _say_once(ctxt, "no-wrapper", f"the server's {msg.metadata.message_type!r} "
                      f"message carries arrays but no {META!r} record (its strategy is not "
                      "wrapped in TernaryDelta, or the arrays are not the global model): "
                      "messages and replies pass through uncompressed")  # fmt: skip
        return call_next(msg, ctxt)
    try:
        broadcast = parse_broadcast(msg.content)
        model = _reach(broadcast, msg.content, ctxt.state)
    except ValueError as err:  # BroadcastError, PayloadError, malformed records
        _forget(ctxt.state)
        reason = f"ternary_mod: cannot apply the broadcast model: {err}"
        log(_WARNING, reason)
        return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)
    if GRID not in msg.content:  # the grid's state is saved by _reach
        _save_model(ctxt.state, broadcast.version, model.floats)

    content = RecordDict()
    for name, record in msg.content.items():
        if name in (META, UPDATES, GRID, GRID_LAYOUT):
            continue
        if name == broadcast.record:
            record = join_model(model.names, model.floats, model.others)
        content[name] = record
    msg.content = content  # the message as the strategy built it, with the whole model
    reply = call_next(msg, ctxt)
    if reply.has_error() or not reply.has_content():
        return reply
    reply.content = _compress_reply(reply.content, broadcast, model, ctxt)
    return reply


def _reach(broadcast: Broadcast, content: RecordDict, state: RecordDict) -> SplitModel:
    """The broadcast model at ``broadcast.version`` (float tensors, other Arrays)."""
    if GRID in content:
        model, grid = reach_grid(broadcast, content, state)
        if digest(model.floats) != broadcast.digest:
            raise BroadcastError(
                f"the model at version {broadcast.version} fails its digest check"
            )
        save_grid(state, grid, broadcast.version)
        return model
    record = content[broadcast.record]
    assert isinstance(record, ArrayRecord)  # parse_broadcast checked it
    received = split_model(record)
    if broadcast.base == -1:
        if received.names != broadcast.names:
            raise BroadcastError("the model record does not hold the announced arrays")
        model = received
    else:
        held_version, held = _load_model(state)
        if held_version != broadcast.base or held is None:
            raise BroadcastError(
                f"the update starts from version {broadcast.base} but this client holds "
                f"{'none' if held_version is None else held_version}"
            )
        if list(received.floats) or set(received.names) != set(broadcast.names) - set(held):
            raise BroadcastError("the model record of an update must hold the non-float arrays")
        updates = content.get(UPDATES)
        if not isinstance(updates, ArrayRecord):
            raise BroadcastError(f"the message has no {UPDATES!r} ArrayRecord")
        floats = held
        spec = _spec(broadcast, held)
        for version in range(broadcast.base + 1, broadcast.version + 1):
            array = updates.get(update_key(version))
            if array is None:
                raise BroadcastError(f"the update to version {version} is missing")
            try:  # the header against the model first, as the server screens replies
                delta = spec.check(array_to_bytes(array), 0).decode()
            except PayloadRejected as err:
                raise BroadcastError(f"the update to version {version}: {err}") from err
            floats = {n: floats[n] + delta[n] for n in floats}
        model = SplitModel(broadcast.names, floats, received.others)
    if digest(model.floats) != broadcast.digest:
        raise BroadcastError(f"the model at version {broadcast.version} fails its digest check")
    if broadcast.base == -1 and GRID_LAYOUT in content:  # a whole model on the grid
        rebuilt = rebuild_grid(content, model.floats)
        if rebuilt is not None:
            save_grid(state, rebuilt, broadcast.version)
    return model


def _spec(broadcast: Broadcast, floats: dict[str, torch.Tensor]) -> PayloadSpec:
    """What the broadcast's updates of ``floats`` must look like."""
    return PayloadSpec.for_shapes(
        {n: tuple(t.shape) for n, t in floats.items()},
        make_compressor(
            broadcast.compressor,
            seed=0,
            clip_sigma=broadcast.clip_sigma,
            scale_bucket=broadcast.scale_bucket,
        ),
        dtypes={n: t.dtype for n, t in floats.items()},
    )


def _compress_reply(
    reply: RecordDict, broadcast: Broadcast, model: SplitModel, ctxt: Context
) -> RecordDict:
    """The reply with its model as an encoded delta (when it has one), plus :data:`META`."""
    key = _model_record_of(reply, broadcast.record, model)
    if key is None:
        if reply.array_records:
            why = _misfit(reply, broadcast.record, model)
            _say_once(ctxt, "no-model", "reply sent uncompressed: no ArrayRecord of the "
                      f"reply has the model's arrays ({why})")  # fmt: skip
        return _compress_reply_plain(reply, broadcast.version)
    record = reply[key]
    assert isinstance(record, ArrayRecord)  # _model_record_of checked it
    delta, dtypes = _reply_delta(record, model)
    memory = (
        ResidualMemory(saved_residuals(ctxt.state, STATE_RESIDUAL, delta))
        if broadcast.error_feedback
        else None
    )
    if memory is None and STATE_RESIDUAL in ctxt.state:  # error feedback has ended
        del ctxt.state[STATE_RESIDUAL]
    seed = derive_seed(broadcast.seed, ctxt.node_id, broadcast.version)
    try:
        compressor = make_compressor(
            broadcast.compressor,
            seed=seed,
            clip_sigma=broadcast.clip_sigma,
            scale_bucket=broadcast.scale_bucket,
        )
        if broadcast.threshold is not None and isinstance(compressor, TernaryCompressor):
            compressor.threshold = broadcast.threshold
        payload = encode_update(delta, compressor, memory)
    except (ValueError, TypeError) as err:  # e.g. NaN weights: send the reply as it is
        _say_once(ctxt, "encode", f"reply sent uncompressed: its delta cannot be encoded: {err}")
        return _compress_reply_plain(reply, broadcast.version)
    if memory is not None:
        save_residuals(ctxt.state, STATE_RESIDUAL, memory.residuals)
    out = RecordDict()
    for name, found in reply.items():
        if name == key:
            found = ArrayRecord({n: record[n] for n in model.others})  # type: ignore[arg-type]
        out[name] = found
    out[DELTA] = ArrayRecord({DELTA_KEY: bytes_to_array(payload)})  # type: ignore[arg-type]
    held = [t.dtype for t in model.floats.values()]
    named = None if [FLOAT_DTYPES[d] for d in dtypes] == held else dtypes  # None: as held
    out[META] = ReplyMeta(broadcast.version, key, model.names, named).to_record()
    return out


def _reply_delta(
    record: ArrayRecord, model: SplitModel
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``record``'s float arrays minus the broadcast model, in :data:`UPLINK_DTYPE`
    (subtracted in the wider of the two dtypes), and the dtype of each as the app sent it.

    An integer array where the model has floats (FedAvg averages ``num_batches_tracked``
    into float64) is read as the model's dtype, and restored in it.
    """
    delta, dtypes = {}, []
    for name, held in model.floats.items():
        values = np.asarray(record[name].numpy())
        if values.dtype.kind != "f":
            values = values.astype(held.numpy().dtype)
        sent = torch.from_numpy(np.array(values, copy=True))
        wide = torch.promote_types(torch.promote_types(sent.dtype, held.dtype), UPLINK_DTYPE)
        delta[name] = (sent.to(wide) - held.to(wide)).to(UPLINK_DTYPE)
        dtypes.append(str(values.dtype))
    return delta, dtypes


def _compress_reply_plain(reply: RecordDict, version: int) -> RecordDict:
    out = RecordDict()
    for name, record in reply.items():
        out[name] = record
    out[META] = ReplyMeta(version).to_record()
    return out


def _model_record_of(reply: RecordDict, preferred: str, model: SplitModel) -> str | None:
    """Name of the reply's ArrayRecord shaped like the model (``preferred`` first)."""
    candidates = [preferred, *(k for k in reply.array_records if k != preferred)]
    for key in candidates:
        record = reply.get(key)
        if isinstance(record, ArrayRecord) and _misfit_of(record, model) is None:
            return key
    return None


def _misfit(reply: RecordDict, preferred: str, model: SplitModel) -> str:
    """Why the reply's ArrayRecord ``preferred`` (else its first one) is not the model."""
    key = preferred if isinstance(reply.get(preferred), ArrayRecord) else None
    key = key if key is not None else next(iter(reply.array_records))
    record = reply[key]
    assert isinstance(record, ArrayRecord)
    return f"record {key!r}: {_misfit_of(record, model)}"


def _misfit_of(record: ArrayRecord, model: SplitModel) -> str | None:
    """Why ``record`` cannot travel as a delta of ``model`` (None: it can). Its names and
    shapes must be the model's; a float array of the model may come back in any float dtype
    of :data:`FLOAT_DTYPES` or as integers; the other arrays keep their dtype."""
    names = list(record.keys())
    if names != model.names:
        pairs = enumerate(zip(names, model.names, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), None)
        if at is None:
            return f"it has {len(names)} arrays, the model {len(model.names)}"
        return f"its array {at} is {names[at]!r}, the model's is {model.names[at]!r}"
    for name, tensor in model.floats.items():
        array = record[name]
        if tuple(array.shape) != tuple(tensor.shape):
            return f"array {name!r} has shape {list(array.shape)}, not {list(tensor.shape)}"
        try:
            kind: str = np.dtype(array.dtype).kind
        except TypeError:
            kind = "?"
        if not (array.dtype in FLOAT_DTYPES or kind in "iub") or array.stype != "numpy.ndarray":
            return f"array {name!r} is of dtype {array.dtype!r}, which is not compressed"
    for name, other in model.others.items():
        array = record[name]
        if array.dtype != other.dtype or tuple(array.shape) != tuple(other.shape):
            return (
                f"array {name!r} is {array.dtype}{list(array.shape)}, the model's "
                f"{other.dtype}{list(other.shape)} (it travels exact)"
            )
    return None


def _say_once(ctxt: Context, reason: str, text: str) -> None:
    """Log ``text`` on Flower's logger unless this node already said ``reason``."""
    said = ctxt.state.get(STATE_SAID)
    found = said.get("reasons") if isinstance(said, ConfigRecord) else None
    reasons = [str(r) for r in found] if isinstance(found, list) else []
    if reason in reasons:
        return
    log(_WARNING, "ternary_mod (node %s): %s", ctxt.node_id, text)
    ctxt.state[STATE_SAID] = ConfigRecord({"reasons": [*reasons, reason]})


# ------------------------------------------------------------------ context.state
def _save_model(state: RecordDict, version: int, floats: dict[str, torch.Tensor]) -> None:
    blob, layout = pack_tensors(floats)
    state[STATE_MODEL] = ArrayRecord({_BLOB: blob})  # type: ignore[arg-type]
    state[STATE_MODEL_LAYOUT] = layout
    state[STATE_META] = ConfigRecord({"version": version})


def _load_model(state: RecordDict) -> tuple[int | None, dict[str, torch.Tensor] | None]:
    meta, record = state.get(STATE_META), state.get(STATE_MODEL)
    layout = state.get(STATE_MODEL_LAYOUT)
    if not (
        isinstance(meta, ConfigRecord)
        and isinstance(record, ArrayRecord)
        and isinstance(layout, ConfigRecord)
        and _BLOB in record
    ):
        return None, None
    version = meta.get("version")
    if not isinstance(version, int):
        return None, None
    return version, unpack_tensors(record[_BLOB], layout)


def _forget(state: RecordDict) -> None:
    for key in (STATE_MODEL, STATE_MODEL_LAYOUT, STATE_META):
        if key in state:
            del state[key]
    forget_grid(state)
