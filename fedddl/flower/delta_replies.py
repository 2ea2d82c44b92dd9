"""What :class:`~fedddl.flower.TernaryDelta` does to messages and replies around the
wrapped strategy: finds the record that carries the global model, rebuilds a reply's model
from its delta, strips the wrapper's records, and names a fault's kind.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from fedddl.flower.delta_protocol import DELTA, FLOAT_DTYPES, META, UPLINK_DTYPE, same_layout
from fedddl.sync.errors import ReplyError

__all__ = [
    "error_reply",
    "fault_kind", "model_key", "non_finite_array", "restored", "without_ours",
]


def restored(
    exact: dict[str, torch.Tensor], delta: dict[str, torch.Tensor], dtypes: list[str]
) -> dict[str, torch.Tensor]:
    """The global model plus a reply's delta, added in the wider dtype, in the reply's
    ``dtypes``."""
    out = {}
    for i, (name, tensor) in enumerate(exact.items()):
        dtype = FLOAT_DTYPES[dtypes[i]]
        wide = torch.promote_types(tensor.dtype, UPLINK_DTYPE)
        out[name] = (tensor.to(wide) + delta[name].to(wide)).to(dtype)
    return out


def without_ours(reply: Message, record: str | None, model: ArrayRecord | None) -> Message:
    """``reply`` without this wrapper's records, its ``record`` replaced by ``model``."""
    out = RecordDict()
    for name, found in reply.content.items():
        if name in (META, DELTA):
            continue
        out[name] = model if name == record and model is not None else found
    reply.content = out
    return reply


def fault_kind(error: ReplyError | None) -> str:
    """The kind of fault: the error that caused the rejection, else the rejection's class."""
    if error is None:
        return "rejected"
    cause = error.__cause__
    return type(cause if isinstance(cause, Exception) else error).__name__


def model_key(message: Message, arrays: ArrayRecord) -> str | None:
    """Name of the record in ``message`` that carries the global model, if any."""
    if message.has_error() or not message.has_content():
        return None
    records = message.content.array_records
    for key, record in records.items():
        if record is arrays:
            return key
    for key, record in records.items():
        if same_layout(record, arrays):
            return key
    return None


def non_finite_array(arrays: ArrayRecord) -> str | None:
    """The name of a float Array of ``arrays`` with a non-finite value, if any."""
    for name, array in arrays.items():
        try:
            values = array.numpy()
        except Exception:  # not readable: not ours to judge
            continue
        if values.dtype.kind == "f" and not bool(np.isfinite(values).all()):
            return name
    return None


def error_reply(instruction: Message, reason: str) -> Message:
    """The error reply that stands for a dropped reply to ``instruction``."""
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason),
                   reply_to=instruction)  # fmt: skip
