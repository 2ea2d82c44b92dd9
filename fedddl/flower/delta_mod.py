"""``ternary_mod``: a Flower client mod that sends and receives ternary model deltas.

Add it to any ClientApp; the training code stays as it is::

    from fedddl.flower import ternary_mod

    app = ClientApp(mods=[ternary_mod])

and wrap the server's strategy in :class:`fedddl.flower.TernaryDelta`. On a message
that the wrapper compressed (:mod:`fedddl.flower.delta_protocol`), the mod

1. brings the broadcast model it keeps in ``context.state`` to the message's version
   (applying the ternary updates, or taking the whole model), checks its digest, and
   hands the app the message as the strategy built it, with the whole model;
2. encodes the app's reply model as ``reply - broadcast model`` with the ternary
   compressor the server names and error feedback (the residual is kept in
   ``context.state``), when the reply carries an ArrayRecord shaped like the model.

A message without the wrapper's record, and a reply without such a model, pass through
unchanged. When the broadcast cannot be applied (wrong base version, digest mismatch,
malformed update) the mod forgets its broadcast model and answers with an error reply
(``MOD_FAILED_PRECONDITION``) instead of calling the app; the server then sends this
node the whole model. Put ``ternary_mod`` first in ``mods`` so that other mods (e.g.
Flower's clipping mods) see whole models.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

from fedddl.compression import ResidualMemory, encode_update, make_compressor
from fedddl.flower.delta_protocol import (
    DELTA,
    DELTA_KEY,
    META,
    UPDATES,
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

__all__ = ["STATE_MODEL", "STATE_RESIDUAL", "ternary_mod"]

_log = logging.getLogger("fedddl")

#: ``context.state`` records of the mod: the broadcast model (packed) with its layout and
#: version, and the uplink residuals.
STATE_MODEL = "fedddl.ternary.model"
STATE_MODEL_LAYOUT = "fedddl.ternary.model-layout"
STATE_META = "fedddl.ternary.state"
STATE_RESIDUAL = "fedddl.ternary.residual"
_BLOB = "blob"


class BroadcastError(ValueError):
    """The broadcast cannot be applied to the model this client holds."""


def ternary_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Decode ternary model deltas on the way in, encode the reply's delta on the way out.

    See the module docstring; the server side is :class:`fedddl.flower.TernaryDelta`.
    """
    if msg.has_error() or not msg.has_content() or META not in msg.content:
        return call_next(msg, ctxt)
    try:
        broadcast = parse_broadcast(msg.content)
        model = _reach(broadcast, msg.content, ctxt.state)
    except ValueError as err:  # BroadcastError, PayloadError, malformed records
        _forget(ctxt.state)
        reason = f"ternary_mod: cannot apply the broadcast model: {err}"
        _log.warning(reason)
        return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)
    _save_model(ctxt.state, broadcast.version, model.floats)

    content = RecordDict()
    for name, record in msg.content.items():
        if name in (META, UPDATES):
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
    out = RecordDict()
    if key is None:
        for name, record in reply.items():
            out[name] = record
        out[META] = ReplyMeta(broadcast.version).to_record()
        return out
    weights = _reply_floats(reply[key], model)  # type: ignore[arg-type]
    delta = {n: weights[n] - model.floats[n] for n in model.floats}
    memory = (
        ResidualMemory(saved_residuals(ctxt.state, STATE_RESIDUAL, delta))
        if broadcast.error_feedback
        else None
    )
    seed = derive_seed(broadcast.seed, ctxt.node_id, broadcast.version)
    try:
        compressor = make_compressor(
            broadcast.compressor,
            seed=seed,
            clip_sigma=broadcast.clip_sigma,
            scale_bucket=broadcast.scale_bucket,
        )
        payload = encode_update(delta, compressor, memory)
    except (ValueError, TypeError) as err:  # e.g. NaN weights: send the reply as it is
        _log.warning("ternary_mod: reply sent uncompressed: %s", err)
        return _compress_reply_plain(reply, broadcast.version)
    if memory is not None:
        save_residuals(ctxt.state, STATE_RESIDUAL, memory.residuals)
    for name, record in reply.items():
        if name == key:
            model_record = reply[key]
            assert isinstance(model_record, ArrayRecord)
            record = ArrayRecord({n: model_record[n] for n in model.others})  # type: ignore[arg-type]
        out[name] = record
    out[DELTA] = ArrayRecord({DELTA_KEY: bytes_to_array(payload)})  # type: ignore[arg-type]
    out[META] = ReplyMeta(broadcast.version, key, model.names).to_record()
    return out


def _reply_floats(record: ArrayRecord, model: SplitModel) -> dict[str, torch.Tensor]:
    """The reply's values of the model's float arrays, in the model's dtypes.

    An integer array the strategy turned into floats (FedAvg averages
    ``num_batches_tracked`` into float64) is cast back to the model's dtype.
    """
    out = {}
    for name, like in model.floats.items():
        values = np.asarray(record[name].numpy(), dtype=like.numpy().dtype)
        out[name] = torch.from_numpy(np.array(values, copy=True))
    return out


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
        if isinstance(record, ArrayRecord) and _fits(record, model):
            return key
    return None


def _fits(record: ArrayRecord, model: SplitModel) -> bool:
    """Same names and shapes as the model; a float array's reply is of its dtype, or an
    integer one (cast back, see :func:`_reply_floats`); other arrays keep their dtype."""
    if list(record.keys()) != model.names:
        return False
    for name, tensor in model.floats.items():
        array = record[name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        try:
            kind = np.dtype(array.dtype).kind
        except TypeError:
            return False
        if tuple(array.shape) != tuple(tensor.shape):
            return False
        if array.dtype != dtype and kind not in "iub":
            return False
    return all(
        record[n].dtype == a.dtype and tuple(record[n].shape) == tuple(a.shape)
        for n, a in model.others.items()
    )


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
