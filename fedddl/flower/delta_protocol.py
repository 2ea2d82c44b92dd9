"""Ternary model deltas in Flower messages: every record and key of
:func:`~fedddl.flower.delta_mod.ternary_mod` and
:class:`~fedddl.flower.ternary_delta.TernaryDelta`, once.

Both sides import this module. A message that carries the model gets a :data:`META`
``ConfigRecord`` (the model record's name and array names, the broadcast ``version``
the client must hold, ``base``: -1 for the whole model, else the version the
:data:`UPDATES` deltas start from, the ``digest`` of the broadcast float arrays, and
the uplink settings); a reply carries ``META`` (the version it holds) and, when its
model travels compressed, the :data:`DELTA` record against the broadcast model. Float
arrays (float16, float32, float64 stored as numpy arrays) are compressed, others (integer
buffers, dtypes numpy does not know such as bfloat16) travel exact. Uplink deltas are
computed and encoded in :data:`UPLINK_DTYPE` whatever the model's dtype; the reply's
``META`` names the dtype of each compressed array as the client sent it, and the server
restores it in that dtype. A message without ``META`` is not compressed and passes through
unchanged. Every record and key in full: docs/drop-in-compression.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedddl.training import tensors_fingerprint

__all__ = [
    "DELTA",
    "DELTA_KEY",
    "FLOAT_DTYPES",
    "META",
    "UPDATES",
    "UPLINK_DTYPE",
    "Broadcast",
    "ReplyMeta",
    "SplitModel",
    "digest",
    "join_model",
    "parse_broadcast",
    "parse_reply_meta",
    "same_layout",
    "split_model",
    "update_key",
]

META = "fedddl.ternary"
UPDATES = "fedddl.ternary.updates"
DELTA = "fedddl.ternary.delta"
DELTA_KEY = "delta"
#: The Array dtypes that are compressed, by name.
FLOAT_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
#: The dtype of every uplink delta on the wire (and of the client's residual memory).
UPLINK_DTYPE = torch.float32
_NUMPY_STYPE = "numpy.ndarray"


def update_key(version: int) -> str:
    """Key of the update that makes broadcast version ``version`` in :data:`UPDATES`."""
    return f"v{version}"


@dataclass
class SplitModel:
    """A model ArrayRecord split into float tensors (compressed) and other Arrays (exact)."""

    names: list[str]
    floats: dict[str, torch.Tensor]
    others: dict[str, Array]


def _dtype_of(name: str, array: Array) -> str | None:
    """The name of ``array``'s dtype when it is compressed (see :data:`FLOAT_DTYPES`)."""
    if not isinstance(array, Array):
        raise ValueError(f"array {name!r} is a {type(array).__name__}, not a flwr Array")
    if array.stype != _NUMPY_STYPE or not isinstance(array.dtype, str):
        return None
    try:
        dtype = str(np.dtype(array.dtype))
    except TypeError:  # e.g. "bfloat16" without a numpy extension: travels exact
        return None
    return dtype if dtype in FLOAT_DTYPES else None


def split_model(record: ArrayRecord) -> SplitModel:
    """Split ``record`` into float tensors (own memory) and the other Arrays, in order.

    Float tensors are the numpy-serialized Arrays of a :data:`FLOAT_DTYPES` dtype; every
    other Array (integer buffers, bfloat16 or another dtype numpy does not know, another
    serialization) is kept as it is.

    Raises
    ------
    ValueError
        If an Array cannot be read.
    """
    names: list[str] = []
    floats: dict[str, torch.Tensor] = {}
    others: dict[str, Array] = {}
    for name, array in record.items():
        names.append(name)
        dtype = _dtype_of(name, array)
        if dtype is None:
            others[name] = array
            continue
        try:
            values = np.array(array.numpy(), copy=True)
        except Exception as err:  # a malformed Array: whatever numpy raises
            raise ValueError(f"array {name!r} cannot be read: {err}") from err
        if values.dtype != np.dtype(dtype) or tuple(values.shape) != tuple(array.shape):
            raise ValueError(f"array {name!r} does not hold its declared dtype and shape")
        floats[name] = torch.from_numpy(values)
    return SplitModel(names, floats, others)


def join_model(
    names: list[str], floats: Mapping[str, torch.Tensor], others: Mapping[str, Array]
) -> ArrayRecord:
    """The model ArrayRecord of ``names``: float tensors and other Arrays, in that order."""
    arrays: dict[str, Array] = {}
    for name in names:
        if name in floats:
            arrays[name] = Array(floats[name].detach().cpu().contiguous().numpy())
        else:
            arrays[name] = others[name]
    return ArrayRecord(arrays)  # type: ignore[arg-type]


def same_layout(a: ArrayRecord, b: ArrayRecord) -> bool:
    """Whether two ArrayRecords have the same names (in order), dtypes and shapes."""
    if list(a.keys()) != list(b.keys()):
        return False
    for name in a:
        x, y = a[name], b[name]
        if not isinstance(x, Array) or not isinstance(y, Array):
            return False
        if x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
            return False
    return True


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The first 128 bits (hex) of :func:`fedddl.training.tensors_fingerprint`, the
    fingerprint TernGrad's replicas are checked with."""
    return tensors_fingerprint(tensors)[:32]


@dataclass(frozen=True)
class Broadcast:
    """The :data:`META` record of a server → client message."""

    record: str
    names: list[str]
    version: int
    base: int
    digest: str
    compressor: str
    clip_sigma: float
    error_feedback: bool
    seed: int
    scale_bucket: int = 0
    #: The uplink's cut for this reply (a ternary compressor's ``threshold``); None: the
    #: compressor's own.
    threshold: float | None = None

    def to_record(self) -> ConfigRecord:
        """As the :data:`META` ConfigRecord (``scale-bucket`` only when not 0,
        ``threshold`` only when set)."""
        record = ConfigRecord(
            {
                "record": self.record,
                "names": list(self.names),
                "version": self.version,
                "base": self.base,
                "digest": self.digest,
                "compressor": self.compressor,
                "clip-sigma": self.clip_sigma,
                "error-feedback": self.error_feedback,
                "seed": self.seed,
            }
        )
        if self.scale_bucket:
            record["scale-bucket"] = self.scale_bucket
        if self.threshold is not None:
            record["threshold"] = self.threshold
        return record


def _get(meta: ConfigRecord, key: str, kind: type | tuple[type, ...]) -> object:
    value = meta.get(key)
    if isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{META} key {key!r} must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"{META} key {key!r} must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _names(meta: ConfigRecord) -> list[str]:
    names = meta.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{META} key 'names' must be a list of strings")
    if len(set(names)) != len(names):
        raise ValueError(f"{META} key 'names' repeats a name")
    return [str(n) for n in names]


def _meta(content: RecordDict) -> ConfigRecord:
    meta = content.get(META)
    if not isinstance(meta, ConfigRecord):
        raise ValueError(f"record {META!r} is a {type(meta).__name__}, not a ConfigRecord")
    return meta


def _scale_bucket(meta: ConfigRecord) -> int:
    """The optional ``scale-bucket`` key (absent: 0, one scale per tensor)."""
    if "scale-bucket" not in meta:
        return 0
    value = _get(meta, "scale-bucket", int)
    assert isinstance(value, int)
    return value


def _threshold(meta: ConfigRecord) -> float | None:
    """The optional ``threshold`` key (absent: None, the compressor's own cut)."""
    if "threshold" not in meta:
        return None
    value = float(_get(meta, "threshold", (int, float)))  # type: ignore[arg-type]
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{META}: threshold must be in [0, 1], got {value}")
    return value


def parse_broadcast(content: RecordDict) -> Broadcast:
    """Read and check the :data:`META` record of a server → client message.

    Raises
    ------
    ValueError
        Naming the missing or malformed key.
    """
    meta = _meta(content)
    broadcast = Broadcast(
        record=str(_get(meta, "record", str)),
        names=_names(meta),
        version=int(_get(meta, "version", int)),  # type: ignore[call-overload]
        base=int(_get(meta, "base", int)),  # type: ignore[call-overload]
        digest=str(_get(meta, "digest", str)),
        compressor=str(_get(meta, "compressor", str)),
        clip_sigma=float(_get(meta, "clip-sigma", (int, float))),  # type: ignore[arg-type]
        error_feedback=bool(_get(meta, "error-feedback", bool)),
        seed=int(_get(meta, "seed", int)),  # type: ignore[call-overload]
        scale_bucket=_scale_bucket(meta),
        threshold=_threshold(meta),
    )
    if broadcast.scale_bucket < -1:
        raise ValueError(f"{META}: scale-bucket must be >= -1, got {broadcast.scale_bucket}")
    if broadcast.version < 1 or not -1 <= broadcast.base <= broadcast.version:
        raise ValueError(
            f"{META}: version {broadcast.version} / base {broadcast.base} are inconsistent"
        )
    if not (math.isfinite(broadcast.clip_sigma) and broadcast.clip_sigma > 0):
        raise ValueError(f"{META}: clip-sigma must be > 0, got {broadcast.clip_sigma}")
    if not isinstance(content.get(broadcast.record), ArrayRecord):
        raise ValueError(f"the message has no model ArrayRecord {broadcast.record!r}")
    return broadcast


@dataclass(frozen=True)
class ReplyMeta:
    """The :data:`META` record of a reply: the version held, and what was compressed.

    ``dtypes``: the dtype the client sent each compressed (float) array in, in ``names``
    order; None (left out when they are the broadcast model's): the broadcast model's.
    """

    version: int
    record: str | None = None
    names: list[str] | None = None
    dtypes: list[str] | None = None

    def to_record(self) -> ConfigRecord:
        """As the :data:`META` ConfigRecord."""
        out = ConfigRecord({"version": self.version})
        if self.record is not None and self.names is not None:
            out["record"] = self.record
            out["names"] = list(self.names)
            if self.dtypes is not None:
                out["dtypes"] = list(self.dtypes)
        return out


def parse_reply_meta(content: RecordDict) -> ReplyMeta:
    """Read and check the :data:`META` record of a reply.

    Raises
    ------
    ValueError
        Naming the missing or malformed key.
    """
    meta = _meta(content)
    version = int(_get(meta, "version", int))  # type: ignore[call-overload]
    if "record" not in meta:
        return ReplyMeta(version)
    record = str(_get(meta, "record", str))
    if "dtypes" not in meta:
        return ReplyMeta(version, record, _names(meta))
    dtypes = meta.get("dtypes")
    if not isinstance(dtypes, list) or not all(d in FLOAT_DTYPES for d in dtypes):
        raise ValueError(f"{META} key 'dtypes' must be a list of {', '.join(FLOAT_DTYPES)}")
    return ReplyMeta(version, record, _names(meta), [str(d) for d in dtypes])
