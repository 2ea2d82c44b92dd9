"""The wire format of an update: ``encode_update`` / ``decode_update``.

Byte layout (version 1, all integers little-endian)::

    offset  size  field
    0       4     magic  b"FDTQ"
    4       1     version = 1
    5       1     flags = 0 (reserved)
    6       4     u32 count: number of tensors (<= MAX_TENSORS)
    10      8     u64 total length of the message in bytes, CRC included
    18      ...   count entries, each:
                    u16  name length L (<= MAX_NAME_BYTES), then L bytes UTF-8 name
                    u8   dtype: 1 float32, 2 float64, 3 float16, 4 bfloat16
                    u8   kind:  0 dense, 1 ternary 2-bit, 2 ternary base-3
                    u8   ndim (<= MAX_NDIM), then ndim x u64 dims (each <= MAX_DIM)
                    f32  scale s (ternary kinds only; finite, >= 0)
    ...     ...   data of every entry, in entry order:
                    dense:    numel * itemsize raw bytes of the dtype
                    2-bit:    ceil(numel / 4) bytes, 4 codes per byte
                    base-3:   ceil(numel / 5) bytes, 5 codes per byte
                  (code layout: :mod:`fedddl.compression.packing`)
    end-4   4     u32 zlib.crc32 of every preceding byte

A compressor whose ``entropy_coding`` is ``"zstd"`` (``ternary-entropy``) gets the
same count, entries and data zstd-coded in an ``FDTE`` message when that is
smaller (:mod:`fedddl.compression.entropy`); :func:`decode_update` reads both.

A ternary entry decodes to ``s * code`` computed in float32, then cast to
``dtype``; a dense entry to its raw values.  Data sizes follow from the header
alone and must add up to exactly the bytes present, which is checked before
any tensor is allocated, so a hostile header cannot make the decoder allocate
more than the message size.  Sizes are always ``len(encode_update(...))``.

:func:`read_header` reads and checks the header alone (no tensor is allocated,
no value decoded), so a receiver can compare names, shapes, dtypes, codecs and
scales with what it expects before it decodes anything; ``max_bytes`` and
``max_tensors`` reject an oversized message before its entries are parsed.
:func:`open_message` does the same and keeps what it read: the receiver then
decodes (:meth:`OpenedMessage.decode`) without reading the header again.
"""

from __future__ import annotations

import math
import struct
import warnings
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, overload

import numpy as np
import torch

from fedddl.compression.base import Compressor
from fedddl.compression.device_path import to_host, unpack_into, unpacks_on_device
from fedddl.compression.entropy import MAGIC as ENTROPY_MAGIC
from fedddl.compression.entropy import open_entropy_coded, seal_entropy_coded
from fedddl.compression.errors import PayloadError
from fedddl.compression.identity import IdentityCompressor as _Identity
from fedddl.compression.memory import Memory
from fedddl.compression.message_buffer import MessageBuffer, NonFiniteValues
from fedddl.compression.packing import (
    invalid_code_rows,
    invalid_codes,
    is_small,
    packed_size,
    unpack_code_rows,
    unpack_codes,
    unpack_codes_batch,
    unpack_codes_into,
    unpack_codes_new,
)
from fedddl.compression.parallel import copy_bytes, copy_pieces, crc32_threaded
from fedddl.compression.payload import (
    Context,
    DensePayload,
    Payload,
    TernaryPayload,
    check_float_tensor,
)
from fedddl.framing import CRC as _CRC
from fedddl.framing import check_crc, check_magic, crc32_of

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_DIM",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "MAX_TENSORS",
    "EntryHeader",
    "OpenedMessage",
    "decode_small_batch",
    "decode_update",
    "encode_update",
    "open_message",
    "read_header",
]

MAGIC = b"FDTQ"
FORMAT_VERSION = 1
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 1024
MAX_NDIM = 16
MAX_DIM = 1 << 48  # torch shapes are int64; no real tensor comes near this

_PREFIX = struct.Struct("<4sBBIQ")
_MAX_SPAN = 1 << 62  # product of the non-zero dimensions (even of an empty tensor)
_COUNT = struct.Struct("<I")  # the tensor count that opens an entropy-coded body
_MIN_ENTRY = 2 + 3  # empty name, dtype, kind, ndim
_KIND_DENSE, _KIND_2BIT, _KIND_BASE3 = 0, 1, 2
_KIND_OF_CODEC = {"2bit": _KIND_2BIT, "base3": _KIND_BASE3}
_CODEC_OF_KIND = {v: k for k, v in _KIND_OF_CODEC.items()}
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
}
_DTYPE_OF_CODE = {v: k for k, v in _DTYPE_CODES.items()}


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":  # e.g. a plug-in compressor's dense payload on a GPU
        flat = to_host(flat)
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _entry_header(name: str, payload: Payload, ctx: Context) -> bytes:
    name_bytes = name.encode("utf-8")
    if len(name_bytes) > MAX_NAME_BYTES:
        raise ValueError(f"tensor name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
    if len(ctx.shape) > MAX_NDIM:
        raise ValueError(f"tensor {name!r} has {len(ctx.shape)} > {MAX_NDIM} dimensions")
    if ctx.dtype not in _DTYPE_CODES:
        raise ValueError(f"tensor {name!r} has unsupported dtype {ctx.dtype}")
    kind = _KIND_DENSE if isinstance(payload, DensePayload) else _KIND_OF_CODEC[payload.codec]
    parts = [
        struct.pack("<H", len(name_bytes)),
        name_bytes,
        struct.pack("<BBB", _DTYPE_CODES[ctx.dtype], kind, len(ctx.shape)),
        struct.pack(f"<{len(ctx.shape)}Q", *ctx.shape),
    ]
    if isinstance(payload, TernaryPayload):
        parts.append(struct.pack("<f", payload.scale))
    return b"".join(parts)


def _entry_data(name: str, payload: Payload, ctx: Context) -> memoryview:
    if isinstance(payload, DensePayload):
        if tuple(payload.values.shape) != ctx.shape or payload.values.dtype != ctx.dtype:
            raise ValueError(f"tensor {name!r}: dense payload does not match its context")
        return _raw_bytes(payload.values)
    if payload.numel != ctx.numel or payload.codes.numel() != packed_size(
        payload.numel, payload.codec
    ):
        raise ValueError(f"tensor {name!r}: ternary payload size does not match its context")
    return _raw_bytes(payload.codes)


def _raise_named(name: str, error: ValueError | TypeError) -> NoReturn:
    """Re-raise ``error`` prefixed with the tensor's name (as it is if it names it)."""
    if str(error).startswith(f"tensor {name!r}"):
        raise error
    kind = ValueError if isinstance(error, ValueError) else TypeError
    raise kind(f"tensor {name!r}: {error}") from error


@contextmanager
def _naming(name: str) -> Iterator[None]:
    """Prefix a ``ValueError`` / ``TypeError`` raised inside with the tensor's name."""
    try:
        yield
    except (ValueError, TypeError) as error:
        _raise_named(name, error)


@overload
def encode_update(
    named_tensors: Mapping[str, torch.Tensor],
    compressor: Compressor,
    memory: Memory | None = None,
    *,
    scales: Mapping[str, float] | None = None,
    clamp: bool = False,
    dense: Collection[str] = (),
    into: None = None,
) -> bytes: ...


@overload
def encode_update(
    named_tensors: Mapping[str, torch.Tensor],
    compressor: Compressor,
    memory: Memory | None = None,
    *,
    scales: Mapping[str, float] | None = None,
    clamp: bool = False,
    dense: Collection[str] = (),
    into: MessageBuffer,
) -> bytes | memoryview: ...


def encode_update(
    named_tensors: Mapping[str, torch.Tensor],
    compressor: Compressor,
    memory: Memory | None = None,
    *,
    scales: Mapping[str, float] | None = None,
    clamp: bool = False,
    dense: Collection[str] = (),
    into: MessageBuffer | None = None,
) -> bytes | memoryview:
    """Compress and serialise ``named_tensors`` into one message.

    Parameters
    ----------
    named_tensors:
        Tensors by name (encoded in the mapping's order).
    compressor:
        Any :class:`Compressor`.
    memory:
        Error-feedback memory: each tensor is ``memory.compensate``-d before
        compression and ``memory.update``-d after, but only once every tensor
        compressed successfully (a failure leaves the memory unchanged).
    scales:
        Optional shared scalers by name, passed to ``compressor.compress(scale=)``.
    clamp:
        With ``scales``: clamp each compensated tensor to ``[-scale, scale]`` before
        compressing it (scaler sharing with scales agreed in an earlier round, which may
        lie below this tensor's own). The memory then keeps what the clamp cut off too.

    dense:
        Names of tensors sent in fp32 (their own dtype) instead of through ``compressor``
        (TernGrad's exemptions: small tensors, the logits layer).
    into:
        Write the message into this reused buffer and return a view of it (valid until
        the next message written into the buffer) instead of new ``bytes``: no page
        faults for a fresh large message (:mod:`fedddl.compression.message_buffer`).
        Entropy-coded messages are new ``bytes`` either way.

    The order is fixed here, in one place: compensate, clamp, compress, update the
    memory, serialise.

    Returns
    -------
    bytes or memoryview
        The message (layout in the module docstring): ``bytes``, or a view of ``into``.

    Raises
    ------
    ValueError
        Naming the tensor: non-finite values, bad scale, name too long, ...
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a Compressor, got {type(compressor).__name__}")
    if len(named_tensors) > MAX_TENSORS:
        raise ValueError(f"{len(named_tensors)} tensors exceed the limit of {MAX_TENSORS}")
    unknown = set(scales or {}) - set(named_tensors)
    if unknown:
        raise ValueError(f"scales given for unknown tensors: {sorted(unknown)}")
    names: list[str] = []
    compensated: list[torch.Tensor] = []
    for name, tensor in named_tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if memory is None:
            compensated.append(tensor)
        else:
            with _naming(name):
                compensated.append(memory.compensate(name, tensor))
        names.append(name)
    shared = [None if scales is None else scales.get(name) for name in names]
    inputs = compensated
    if clamp:
        inputs = [
            t if s is None else t.clamp(-s, s) for t, s in zip(compensated, shared, strict=True)
        ]
    exempt = set(dense) & set(names)
    # the fp32 codec into a buffer: float32 values are checked finite while they are copied
    fused_check = into is not None and memory is None and isinstance(compressor, _Identity)
    if exempt:
        compressed = _compress_split(names, inputs, shared, compressor, exempt)
    elif fused_check:
        assert isinstance(compressor, _Identity)
        batch = partial(compressor.compress_batch, defer_float32_check=True)
        compressed = _compress_all(names, inputs, shared, compressor, batch)
    else:
        compressed = _compress_all(names, inputs, shared, compressor)
    headers: list[bytes] = []
    data: list[memoryview] = []
    pending: list[tuple[str, torch.Tensor, Payload, Context]] = []
    name = ""
    try:  # one handler for the loop (a context manager per tensor costs more than framing)
        for name, tensor, (payload, ctx) in zip(names, compensated, compressed, strict=True):
            headers.append(_entry_header(name, payload, ctx))
            data.append(_entry_data(name, payload, ctx))
            pending.append((name, tensor, payload, ctx))
    except (ValueError, TypeError) as error:
        _raise_named(name, error)
    if memory is not None:
        updates = [
            (name, tensor, compressor.decompress(payload, ctx))
            for name, tensor, payload, ctx in pending
        ]
        for name, tensor, decompressed in updates:
            memory.update(name, tensor, decompressed)
    body_length = sum(len(h) for h in headers) + sum(d.nbytes for d in data)
    total = _PREFIX.size + body_length + _CRC.size
    if compressor.entropy_coding == "zstd":
        coded = seal_entropy_coded([_COUNT.pack(len(headers)), *headers, *data], total)
        if coded is not None:
            return coded
    elif compressor.entropy_coding:
        raise ValueError(f"unknown entropy coding {compressor.entropy_coding!r}")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(headers), total)
    if into is not None:  # the CRC is computed as the buffer is filled
        checked = [  # float32 payloads: part 0 is the prefix and the headers, then the data
            1 + k
            for k, (payload, _) in enumerate(compressed)
            if isinstance(payload, DensePayload) and payload.values.dtype == torch.float32
        ] if fused_check else []  # fmt: skip
        try:
            return into.write(
                [prefix + b"".join(headers), *data], total, finite_float32=checked, seal=True
            )
        except NonFiniteValues as error:
            name = names[error.part - 1]
            raise ValueError(f"tensor {name!r}: tensor has NaN or Inf values") from None
    crc = crc32_of(data, crc32_of(headers, zlib.crc32(prefix)))
    return b"".join([prefix, *headers, *data, _CRC.pack(crc)])


def _compress_all(
    names: list[str],
    inputs: list[torch.Tensor],
    shared: list[float | None],
    compressor: Compressor,
    batch: Callable[..., list[tuple[Payload, Context]]] | None = None,
) -> list[tuple[Payload, Context]]:
    """``batch`` (default ``compressor.compress_batch``) on all tensors (one threaded
    pass), or, if it raises, ``compressor.compress`` one by one to name the bad tensor."""
    try:
        return (batch or compressor.compress_batch)(inputs, shared)
    except (ValueError, TypeError):
        compressed = []
        for name, tensor, scale in zip(names, inputs, shared, strict=True):
            with _naming(name):
                compressed.append(compressor.compress(tensor, scale=scale))
        return compressed


def _compress_split(
    names: list[str],
    inputs: list[torch.Tensor],
    shared: list[float | None],
    compressor: Compressor,
    exempt: set[str],
) -> list[tuple[Payload, Context]]:
    """``compressor`` on the tensors not in ``exempt``, the identity on those in it."""
    keep = [i for i, name in enumerate(names) if name not in exempt]
    out: list[tuple[Payload, Context] | None] = [None] * len(names)
    picked = _compress_all(
        [names[i] for i in keep], [inputs[i] for i in keep], [shared[i] for i in keep], compressor
    )
    for i, result in zip(keep, picked, strict=True):
        out[i] = result
    identity = _Identity()
    for i, name in enumerate(names):
        if name in exempt:
            with _naming(name):
                out[i] = identity.compress(inputs[i])
    return [r for r in out if r is not None]


class _Reader:
    """Bounds-checked sequential reads of the header.

    ``what`` names what is read, for the error message; it is a format string completed
    with ``args`` only when the read fails (formatting it for every field costs more than
    the read).
    """

    def __init__(self, data: memoryview, start: int, end: int) -> None:
        self.data, self.pos, self.end = data, start, end

    def _advance(self, size: int, what: str, args: tuple[object, ...]) -> int:
        """Move past ``size`` bytes; return where they start."""
        start = self.pos
        stop = start + size
        if stop > self.end:
            raise PayloadError(f"truncated header while reading {what.format(*args)}")
        self.pos = stop
        return start

    def take(self, size: int, what: str, *args: object) -> memoryview:
        start = self._advance(size, what, args)
        return self.data[start : self.pos]

    def unpack(self, layout: struct.Struct, what: str, *args: object) -> tuple[Any, ...]:
        return layout.unpack_from(self.data, self._advance(layout.size, what, args))


_NAME_LENGTH = struct.Struct("<H")
_ENTRY_CODES = struct.Struct("<BBB")
_SCALE = struct.Struct("<f")
_SHAPE_OF_NDIM = tuple(struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1))


def _check_prefix(view: memoryview) -> int:
    if len(view) < _PREFIX.size + _CRC.size:
        raise PayloadError(f"truncated: {len(view)} bytes is shorter than the fixed header")
    magic, version, flags, count, total = _PREFIX.unpack_from(view)
    check_magic(
        "compressed update",
        magic,
        version,
        expected_magic=MAGIC,
        expected_version=FORMAT_VERSION,
        error=PayloadError,
    )
    if len(view) < total:
        raise PayloadError(f"truncated: header declares {total} bytes, got {len(view)}")
    if len(view) > total:
        raise PayloadError(f"{len(view) - total} trailing bytes after the declared {total}")
    (crc,) = _CRC.unpack_from(view, total - _CRC.size)
    check_crc(
        "compressed update",
        view[: total - _CRC.size],
        crc,
        error=PayloadError,
        checksum=crc32_threaded,  # large messages on the threads
    )
    if flags != 0:
        raise PayloadError(f"unknown flags {flags:#x}")
    return int(count)


def _check_count(count: int, body_size: int) -> None:
    if count > MAX_TENSORS or count * _MIN_ENTRY > body_size:
        raise PayloadError(f"implausible tensor count {count}")


def _parse_entries(
    view: memoryview, count: int, start: int, end: int
) -> tuple[list[tuple[str, torch.dtype, int, tuple[int, ...], float]], int]:
    reader = _Reader(view, start, end)
    entries = []
    seen: set[str] = set()
    for index in range(count):
        (name_length,) = reader.unpack(_NAME_LENGTH, "name length of entry {}", index)
        if name_length > MAX_NAME_BYTES:
            raise PayloadError(f"entry {index}: {name_length}-byte name exceeds {MAX_NAME_BYTES}")
        try:
            name = bytes(reader.take(name_length, "name of entry {}", index)).decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadError(f"entry {index}: name is not valid UTF-8") from None
        if name in seen:
            raise PayloadError(f"tensor name {name!r} is repeated")
        seen.add(name)
        dtype_code, kind, ndim = reader.unpack(_ENTRY_CODES, "{!r} header", name)
        if dtype_code not in _DTYPE_OF_CODE:
            raise PayloadError(f"tensor {name!r}: unknown dtype code {dtype_code}")
        if kind not in (_KIND_DENSE, _KIND_2BIT, _KIND_BASE3):
            raise PayloadError(f"tensor {name!r}: unknown kind {kind}")
        if ndim > MAX_NDIM:
            raise PayloadError(f"tensor {name!r}: {ndim} dimensions exceed {MAX_NDIM}")
        shape = tuple(reader.unpack(_SHAPE_OF_NDIM[ndim], "shape of {!r}", name))
        if any(dim > MAX_DIM for dim in shape):
            raise PayloadError(f"tensor {name!r}: a dimension of {shape} exceeds {MAX_DIM}")
        if math.prod(dim for dim in shape if dim) > _MAX_SPAN:  # torch's strides fit int64
            raise PayloadError(f"tensor {name!r}: shape {shape} spans more than 2**62 values")
        scale = 0.0
        if kind != _KIND_DENSE:
            (raw_scale,) = reader.unpack(_SCALE, "scale of {!r}", name)
            if not math.isfinite(raw_scale):
                raise PayloadError(f"tensor {name!r}: non-finite scale {raw_scale}")
            if raw_scale < 0:
                raise PayloadError(f"tensor {name!r}: negative scale {raw_scale}")
            scale = raw_scale
        entries.append((name, _DTYPE_OF_CODE[dtype_code], kind, shape, scale))
    return entries, reader.pos


@dataclass(frozen=True)
class EntryHeader:
    """One tensor of a message, as its header describes it (see :func:`read_header`).

    Attributes
    ----------
    name : str
        Tensor name.
    dtype : torch.dtype
        The dtype the tensor decodes to.
    codec : str | None
        ``"2bit"`` or ``"base3"`` for a ternary entry, None for a dense one.
    shape : tuple[int, ...]
        Tensor shape.
    scale : float
        The ternary scale (finite, >= 0; 0.0 for a dense entry): every decoded value of a
        ternary entry is ``-scale``, 0 or ``scale``.
    data_bytes : int
        Bytes of the entry's data.
    peak : float | None
        The largest magnitude of the decoded values: ``scale`` for a ternary entry; for a
        dense entry measured when :func:`read_header` was asked for ``dense_peaks``
        (otherwise None).
    """

    name: str
    dtype: torch.dtype
    codec: str | None
    shape: tuple[int, ...]
    scale: float
    data_bytes: int
    peak: float | None = None

    @property
    def numel(self) -> int:
        """Number of values."""
        return math.prod(self.shape)


def read_header(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int | None = None,
    max_tensors: int | None = None,
    dense_peaks: bool = False,
) -> list[EntryHeader]:
    """Read and check a message's header without decoding (or allocating) any tensor.

    Everything :func:`decode_update` checks before it touches the data is checked here:
    magic, version, length, CRC, flags, every entry (names, dtypes, kinds, shapes,
    scales) and that the declared data sizes add up to the bytes present. Code values
    are not read (an invalid code is only found by :func:`decode_update`). An
    entropy-coded message is decompressed first (to at most
    :data:`fedddl.compression.entropy.MAX_EXPANSION` times its size).

    Parameters
    ----------
    data:
        The message.
    max_bytes:
        Reject a message longer than this, before reading anything else.
    max_tensors:
        Reject a message declaring more tensors than this, before parsing its entries.
    dense_peaks:
        Also read the values of the dense entries (only those) to measure their largest
        magnitude (:attr:`EntryHeader.peak`); a non-finite value is then a
        :class:`PayloadError`.

    Returns
    -------
    list[EntryHeader]
        The entries in message order.

    Raises
    ------
    PayloadError
        For any malformed header, or a message over ``max_bytes`` / ``max_tensors``.
    """
    return open_message(
        data, max_bytes=max_bytes, max_tensors=max_tensors, dense_peaks=dense_peaks
    ).entries


def open_message(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int | None = None,
    max_tensors: int | None = None,
    dense_peaks: bool = False,
) -> OpenedMessage:
    """Read and check a message's header (as :func:`read_header`) and keep what decoding
    needs, so that a receiver who checks the entries first decodes without reading the
    header a second time (:meth:`OpenedMessage.decode`).

    Raises
    ------
    PayloadError
        As :func:`read_header`.
    """
    view = _as_view(data, max_bytes)
    body, parsed, start, sizes = _validated_entries(view, max_tensors)
    entries = []
    offset = start
    for (name, dtype, kind, shape, scale), size in zip(parsed, sizes, strict=True):
        peak: float | None = scale
        if kind == _KIND_DENSE:
            peak = _dense_peak(name, body[offset : offset + size], dtype) if dense_peaks else None
        codec = None if kind == _KIND_DENSE else _CODEC_OF_KIND[kind]
        entries.append(EntryHeader(name, dtype, codec, shape, scale, size, peak))
        offset += size
    # an entropy-coded body is our own decompressed copy; other bytes objects are immutable
    stable = body is not view or isinstance(data, bytes)
    return OpenedMessage(entries, _Layout(body, parsed, start, sizes), data, stable)


@dataclass(frozen=True)
class _Layout:
    """Where a checked message's data lies: the body, the parsed entries, where their data
    starts in the body and each entry's data size."""

    body: memoryview
    entries: list[tuple[str, torch.dtype, int, tuple[int, ...], float]]
    start: int
    sizes: list[int]


class OpenedMessage:
    """A message whose header was read and checked by :func:`open_message`.

    Attributes
    ----------
    entries : list[EntryHeader]
        The message's entries, in message order.
    """

    def __init__(
        self,
        entries: list[EntryHeader],
        layout: _Layout,
        data: bytes | bytearray | memoryview,
        stable: bool,
    ) -> None:
        self.entries = entries
        self._layout, self._data, self._stable = layout, data, stable

    def decode(self, out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Decode the message, as :func:`decode_update` (``out`` likewise).

        A message given as ``bytes`` (immutable), or entropy-coded (decompressed into a
        buffer of its own), is decoded from the header read at opening; one in a mutable
        buffer is checked again first, and refused if its header changed since.

        Raises
        ------
        PayloadError
            As :func:`decode_update`; nothing is written partially decoded.
        """
        layout = self._layout
        if not self._stable:
            layout = _Layout(*_validated_entries(_as_view(self._data)))
            if layout.entries != self._layout.entries:
                raise PayloadError("the message's header changed after it was read")
        return _decode(layout, out)


def decode_small_batch(
    messages: Sequence[OpenedMessage], like: Mapping[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]] | None:
    """Decode several small messages of one layout at once, or None.

    Per message, new float32 CPU tensors holding bit for bit what
    ``message.decode(out=like)`` would write into ``like`` (whose tensors only give the
    names, the shapes and that the small in-place path applies; they are not written).
    One numpy pass per tensor over all the messages replaces the per-message steps of
    :meth:`OpenedMessage.decode`, which dominate for small models. The caller bounds
    the memory: ``len(messages)`` rows of every tensor.

    Returns None, having decoded nothing, when the batch does not apply: fewer than two
    messages, a message in a mutable buffer, layouts that differ (names, dtypes, codecs,
    shapes, in order), a layout that ``like`` does not fit or that is not small
    (:func:`~fedddl.compression.packing.is_small`), or an invalid code or non-zero
    padding in any message. Decode those one at a time with :meth:`OpenedMessage.decode`,
    which says what is wrong with which message.
    """
    if len(messages) < 2 or not all(m._stable for m in messages):
        return None
    first = messages[0]._layout
    if not is_small(sum(math.prod(shape) for _, _, _, shape, _ in first.entries)):
        return None  # before comparing layouts: a large model's replies never batch
    shape_of = [entry[:4] for entry in first.entries]
    for message in messages[1:]:
        layout = message._layout
        if (
            layout.start != first.start
            or layout.sizes != first.sizes
            or [entry[:4] for entry in layout.entries] != shape_of
        ):
            return None
    try:
        _check_out(like, first.entries)
    except PayloadError:
        return None
    if not _fits_small_path(first.entries, like):
        return None
    count = len(messages)
    columns: list[tuple[str, np.ndarray[Any, Any]]] = []
    offset = first.start
    for index, ((name, _, kind, shape, _), size) in enumerate(
        zip(first.entries, first.sizes, strict=True)
    ):
        rows = np.empty((count, size), dtype=np.uint8)
        for row, message in zip(rows, messages, strict=True):
            row[:] = np.frombuffer(message._layout.body, dtype=np.uint8, count=size, offset=offset)
        offset += size
        numel = math.prod(shape)
        values = np.empty((count, numel), dtype=np.float32)
        if kind == _KIND_DENSE:  # float32 (the small path's condition): its bytes
            values.view(np.uint8)[:] = rows
        else:
            codec = _CODEC_OF_KIND[kind]
            if invalid_code_rows(rows, numel, codec):
                return None
            scales = np.array([m._layout.entries[index][4] for m in messages], np.float32)
            unpack_code_rows(rows, numel, scales, codec, values)
        columns.append((name, values.reshape(count, *shape)))
    return [
        {name: torch.from_numpy(values[row, ...]) for name, values in columns}
        for row in range(count)
    ]


def _dense_peak(name: str, raw: memoryview, dtype: torch.dtype) -> float:
    """The largest magnitude of a dense entry's values (raw bytes of ``dtype``)."""
    if not len(raw):
        return 0.0
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is not None:  # read in place, two reductions, no copy
        values = np.frombuffer(raw, dtype=numpy_dtype)
        peak = max(float(values.max()), -float(values.min()))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: copied out of
            tensor = torch.frombuffer(raw, dtype=torch.uint8).clone().view(dtype)
        peak = float(tensor.abs().max())
    if not math.isfinite(peak):
        raise PayloadError(f"tensor {name!r}: non-finite value")
    return peak


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _as_view(data: bytes | bytearray | memoryview, max_bytes: int | None = None) -> memoryview:
    """``data`` as a flat byte view, refused when longer than ``max_bytes``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as error:
        raise PayloadError(f"data is not a flat byte buffer: {error}") from None
    if max_bytes is not None and len(view) > max_bytes:
        raise PayloadError(f"message of {len(view)} bytes exceeds the limit of {max_bytes}")
    return view


def _validated_entries(
    view: memoryview, max_tensors: int | None = None
) -> tuple[memoryview, list[tuple[str, torch.dtype, int, tuple[int, ...], float]], int, list[int]]:
    """The body holding the entries, the checked entries, where their data starts in the
    body, and each entry's data size (plain ``FDTQ`` or entropy-coded ``FDTE`` messages)."""
    if bytes(view[: len(ENTROPY_MAGIC)]) == ENTROPY_MAGIC:
        body = open_entropy_coded(view)  # at most MAX_EXPANSION x the message size
        if len(body) < _COUNT.size:
            raise PayloadError(f"entropy-coded body of {len(body)} bytes has no tensor count")
        (count,) = _COUNT.unpack_from(body)
        start, end = _COUNT.size, len(body)
    else:
        body = view
        count = _check_prefix(view)
        start, end = _PREFIX.size, len(view) - _CRC.size
    if max_tensors is not None and count > max_tensors:
        raise PayloadError(f"message declares {count} tensors, at most {max_tensors} expected")
    _check_count(count, end - start)
    entries, data_start = _parse_entries(body, count, start, end)
    sizes = [_data_size(dtype, kind, math.prod(shape)) for _, dtype, kind, shape, _ in entries]
    available = end - data_start
    if sum(sizes) != available:
        raise PayloadError(
            f"declared shapes need {sum(sizes)} data bytes but {available} are present"
        )
    return body, entries, data_start, sizes


def _data_size(dtype: torch.dtype, kind: int, numel: int) -> int:
    if kind == _KIND_DENSE:
        return numel * dtype.itemsize
    return packed_size(numel, _CODEC_OF_KIND[kind])


def _check_out(
    out: Mapping[str, torch.Tensor],
    entries: list[tuple[str, torch.dtype, int, tuple[int, ...], float]],
) -> None:
    """Check that ``out`` has exactly the message's names, with matching shapes."""
    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a mapping of names to tensors, got {type(out).__name__}")
    names = [name for name, *_ in entries]
    missing = sorted(set(names) - set(out))
    unexpected = sorted(set(out) - set(names))
    if missing or unexpected:
        raise PayloadError(
            f"the message's tensors do not match out: not in out {missing}, "
            f"not in the message {unexpected}"
        )
    for name, _, _, shape, _ in entries:
        target = check_float_tensor(out[name])
        if tuple(target.shape) != shape:
            raise PayloadError(
                f"tensor {name!r}: the message's shape {shape} does not match "
                f"out's {tuple(target.shape)}"
            )


#: Dense entries up to this size are decoded into new tensors by one clone of their bytes
#: (larger ones are copied over the threads into new tensors, in pieces).
_SMALL_DENSE_BYTES = 1 << 16


def _is_direct_target(target: torch.Tensor, dtype: torch.dtype) -> bool:
    return target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()


def _decode_entry(
    raw: torch.Tensor,
    entry: tuple[str, torch.dtype, int, tuple[int, ...], float],
    target: torch.Tensor,
) -> torch.Tensor:
    """Decode one validated entry into ``target``, a tensor that is not written directly
    (another dtype or device, not contiguous): decoded, then copied in with a cast."""
    _, dtype, kind, shape, scale = entry
    if kind == _KIND_DENSE:
        values = torch.empty(shape, dtype=dtype)
        copy_bytes(values.reshape(-1).view(torch.uint8).numpy(), raw.numpy())
    else:
        values = unpack_codes(raw, math.prod(shape), scale, _CODEC_OF_KIND[kind])
        values = values.to(dtype).reshape(shape)
    with torch.no_grad():
        target.copy_(values)
    return target


def decode_update(
    data: bytes | bytearray | memoryview,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    max_bytes: int | None = None,
    max_tensors: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a message of :func:`encode_update` into tensors by name.

    Parameters
    ----------
    data:
        The message.
    out:
        Optional tensors to decode into, in place (e.g. a reused aggregation
        buffer or a model's ``.grad`` tensors): exactly the message's names,
        with the same shapes; any supported floating dtype and any device
        (values are cast).  Contiguous float32 CPU tensors are written
        directly, which is about twice as fast as allocating new tensors.
        Ternary entries for tensors off the CPU cross as packed bytes (one
        copy per device) and are unpacked there with torch ops.
        On any error none of them has been written.
    max_bytes, max_tensors:
        As in :func:`read_header`: refuse a longer message, or one declaring more
        tensors, before reading anything else.

    Returns
    -------
    dict[str, torch.Tensor]
        The decoded tensors in message order: new tensors with the original
        shapes and dtypes that own their memory, or the tensors of ``out``.

    Raises
    ------
    PayloadError
        For any malformed input, or a message that does not match ``out``
        (the message names the problem); nothing is returned or written
        partially decoded.
    """
    return _decode(_Layout(*_validated_entries(_as_view(data, max_bytes), max_tensors)), out)


def _decode(layout: _Layout, out: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Decode the data of a checked message (see :func:`decode_update`)."""
    entries = layout.entries
    if out is not None:
        _check_out(out, entries)
        if _fits_small_path(entries, out):
            return _decode_small(layout, out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we copy out of it
        raws = [torch.from_numpy(source) for source in _checked_data(layout)]
    # everything is validated: from here on nothing can fail on the message's account
    # Ternary entries decoded straight into float32 (new tensors, or float32 CPU buffers)
    # are batched: one threaded pass over all of them, however small each one is.
    result: dict[str, torch.Tensor] = {}
    into_buffers = []
    on_device: list[tuple[torch.Tensor, int, float, str, torch.Tensor]] = []
    new_items, new_entries = [], []
    dense_targets: list[np.ndarray[Any, Any]] = []  # fp32 etc. copied as bytes, in one pass
    dense_sources: list[np.ndarray[Any, Any]] = []
    for entry, raw in zip(entries, raws, strict=True):
        name, dtype, kind, shape, scale = entry
        target = None if out is None else out[name]
        if kind == _KIND_DENSE:
            if target is None and raw.numel() <= _SMALL_DENSE_BYTES:  # fewer steps than below
                result[name] = raw.clone().view(dtype).reshape(shape)
            elif target is None or _is_direct_target(target, dtype):
                values = torch.empty(shape, dtype=dtype) if target is None else target
                dense_targets.append(values.detach().reshape(-1).view(torch.uint8).numpy())
                dense_sources.append(raw.numpy())
                result[name] = values
            else:
                result[name] = _decode_entry(raw, entry, target)
            continue
        item = (raw, math.prod(shape), scale, _CODEC_OF_KIND[kind])
        if target is None:
            new_items.append(item)
            new_entries.append(entry)
            result[name] = raw  # placeholder, keeps the message order
        elif unpacks_on_device(target):  # off the CPU: packed bytes go there, unpacked there
            on_device.append((*item, target))
            result[name] = target
        elif _is_direct_target(target, torch.float32):
            into_buffers.append((*item, target.detach().reshape(-1)))
            result[name] = target
        else:
            result[name] = _decode_entry(raw, entry, target)
    copy_pieces(dense_targets, dense_sources)
    unpack_codes_batch(into_buffers)
    unpack_into(on_device)
    for (name, dtype, _, shape, _), flat in zip(
        new_entries, unpack_codes_new(new_items), strict=True
    ):
        result[name] = flat.to(dtype).reshape(shape)
    return result


def _fits_small_path(
    entries: list[tuple[str, torch.dtype, int, tuple[int, ...], float]],
    out: Mapping[str, torch.Tensor],
) -> bool:
    """Whether every entry goes straight into a float32 CPU buffer, and the message is small
    (:func:`~fedddl.compression.packing.is_small`): ternary entries of any dtype (their
    values are computed in float32) and float32 dense ones."""
    numel = 0
    for name, dtype, kind, shape, _ in entries:
        target = out[name]
        if unpacks_on_device(target) or not _is_direct_target(target, torch.float32):
            return False
        if kind == _KIND_DENSE and dtype != torch.float32:
            return False
        numel += math.prod(shape)
    return is_small(numel)


def _checked_data(layout: _Layout) -> list[np.ndarray[Any, Any]]:
    """Each entry's data bytes (read-only views of the body), every ternary code checked.

    Raises
    ------
    PayloadError
        Naming the first tensor with an invalid code or non-zero padding.
    """
    sources = []
    offset = layout.start
    for (name, _, kind, shape, _), size in zip(layout.entries, layout.sizes, strict=True):
        source = np.frombuffer(layout.body, dtype=np.uint8, count=size, offset=offset)
        offset += size
        if kind != _KIND_DENSE:
            problem = invalid_codes(source, math.prod(shape), _CODEC_OF_KIND[kind])
            if problem is not None:
                raise PayloadError(f"tensor {name!r}: {problem}")
        sources.append(source)
    return sources


def _decode_small(layout: _Layout, out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`_decode` of a small message into float32 CPU buffers: every code checked
    first, then each entry written in place with numpy (the same values as the batched
    path: a ternary value is ``scale × code`` in float32, a dense one its bytes)."""
    sources = _checked_data(layout)
    # everything is validated: from here on nothing can fail on the message's account
    result = {}
    for (name, _, kind, shape, scale), source in zip(layout.entries, sources, strict=True):
        target = out[name]
        flat = target.detach().reshape(-1).numpy()
        if kind == _KIND_DENSE:
            flat.view(np.uint8)[:] = source
        else:
            unpack_codes_into(source, math.prod(shape), scale, _CODEC_OF_KIND[kind], flat)
        result[name] = target
    return result
