"""Flower record codecs: raw bytes, tensors and packed tensors in :mod:`flwr.app` records.

* :func:`bytes_to_array` / :func:`array_to_bytes`: raw bytes as a 1-D ``uint8``
  :class:`~flwr.app.Array` (no numpy header; the fastest way bytes travel in Flower).
* :func:`floats_to_array` / :func:`array_to_floats`: a 1-D float32 vector as raw bytes.
* :func:`tensors_to_record` / :func:`record_to_tensors`: named tensors as an
  :class:`~flwr.app.ArrayRecord` of raw little-endian arrays (``stype = "fedddl.raw"``).
* :func:`pack_tensors` / :func:`unpack_tensors`: named tensors in *one* byte Array plus a
  :class:`~flwr.app.ConfigRecord` layout (cheap ``context.state`` writes).
* :func:`saved_residuals` / :func:`save_residuals`: error-feedback residuals in
  ``context.state`` (one format for TernGrad's clients and ``ternary_mod``).
* :func:`content_nbytes`: bytes of a :class:`~flwr.app.RecordDict` as serialized by Flower.
* :func:`record_of`: one record of a given kind by key, without building the filtered
  views (``RecordDict.array_records`` copies every record into a new dict on each access).

Every decoder raises ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

__all__ = [
    "BYTES_STYPE",
    "RAW_STYPE",
    "array_to_bytes",
    "array_to_floats",
    "bytes_to_array",
    "content_nbytes",
    "floats_to_array",
    "pack_tensors",
    "record_of",
    "record_to_tensors",
    "save_residuals",
    "saved_residuals",
    "tensors_to_record",
    "unpack_tensors",
]

BYTES_STYPE = "bytes"

_Record = TypeVar("_Record", ArrayRecord, ConfigRecord, MetricRecord)


def record_of(records: RecordDict, key: str, kind: type[_Record]) -> _Record | None:
    """The record stored under ``key`` if it is a ``kind``, else None.

    Same answer as ``records.array_records.get(key)`` (for ``kind=ArrayRecord``) at the
    cost of one dict lookup: Flower's filtered views rebuild a dict on every access.
    """
    record = records.get(key)
    return record if isinstance(record, kind) else None


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


# ------------------------------------------------------------------ residuals
def saved_residuals(
    state: RecordDict, key: str, like: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The error-feedback residuals :func:`save_residuals` wrote under ``key`` (none: {}).

    With ``like``, only the residuals of its names, shapes and dtypes are returned, and a
    malformed record reads as none.

    Raises
    ------
    ValueError
        Without ``like``, if the record is malformed.
    """
    record = record_of(state, key, ArrayRecord)
    if record is None:
        return {}
    if like is None:
        return record_to_tensors(record)
    try:
        saved = record_to_tensors(record)
    except ValueError:
        return {}
    return {
        n: r
        for n, r in saved.items()
        if n in like and r.shape == like[n].shape and r.dtype == like[n].dtype
    }


def save_residuals(state: RecordDict, key: str, residuals: Mapping[str, torch.Tensor]) -> None:
    """Write ``residuals`` under ``key`` (nothing when there are none)."""
    if residuals:
        state[key] = tensors_to_record(residuals)
