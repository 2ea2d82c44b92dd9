"""Reading and checking a message's header: magic, version, length, CRC, every entry,
and that the declared data sizes add up to the bytes present."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from fedddl.compression.backends.base5 import MAX_BASE5_SCALE
from fedddl.compression.backends.parallel import crc32_threaded
from fedddl.compression.codecs.entropy import MAGIC as ENTROPY_MAGIC
from fedddl.compression.codecs.entropy import EntropyFrame, check_entropy_coded
from fedddl.compression.codecs.errors import PayloadError, PayloadLimitError
from fedddl.compression.codecs.limits import check_limit
from fedddl.compression.codecs.wire.layout import (
    BUCKET,
    BUCKET_KINDS,
    BUCKETS_VERSION,
    COUNT,
    DTYPE_OF_CODE,
    ENTRY_CODES,
    FORMAT_VERSION,
    KIND_BASE5,
    KIND_DENSE,
    KINDS_OF_VERSION,
    MAGIC,
    MAX_DIM,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_SPAN,
    MAX_TENSORS,
    MIN_ENTRY,
    NAME_LENGTH,
    PREFIX,
    SCALE,
    SHAPE_OF_NDIM,
    Entry,
    data_size,
)
from fedddl.framing import CRC, check_crc, check_magic

__all__ = ["Layout", "as_view", "validated_entries"]

#: The longest header an entry can have: name length, name, dtype, kind, ndim, dims, scale,
#: bucket size.
MAX_ENTRY = (
    NAME_LENGTH.size + MAX_NAME_BYTES + ENTRY_CODES.size + 8 * MAX_NDIM + SCALE.size + BUCKET.size
)

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


def _read_prefix(view: memoryview) -> tuple[int, int]:
    """The tensor count and the format version, after checking the magic, the version and
    the length."""
    if len(view) < PREFIX.size + CRC.size:
        raise PayloadError(f"truncated: {len(view)} bytes is shorter than the fixed header")
    magic, version, _, count, total = PREFIX.unpack_from(view)
    check_magic(
        "compressed update",
        magic,
        version,
        expected_magic=MAGIC,
        expected_version=version if version in KINDS_OF_VERSION else FORMAT_VERSION,
        error=PayloadError,
    )
    if len(view) < total:
        raise PayloadError(f"truncated: header declares {total} bytes, got {len(view)}")
    if len(view) > total:
        raise PayloadError(f"{len(view) - total} trailing bytes after the declared {total}")
    return int(count), int(version)


def _check_crc_and_flags(view: memoryview) -> None:
    total = len(view)
    (crc,) = CRC.unpack_from(view, total - CRC.size)
    check_crc(
        "compressed update",
        view[: total - CRC.size],
        crc,
        error=PayloadError,
        checksum=crc32_threaded,  # large messages on the threads
    )
    flags = PREFIX.unpack_from(view)[2]
    if flags != 0:
        raise PayloadError(f"unknown flags {flags:#x}")


def _within_limits(
    view: memoryview,
    count: int,
    start: int,
    end: int,
    max_tensors: int,
    max_values: int,
    version: int,
) -> tuple[list[Entry], int] | None:
    """The entries of a message not yet checked against its CRC, or None if they are
    malformed (the CRC check then says whether they are corrupt).

    Raises
    ------
    PayloadLimitError
        If the header declares more than ``max_tensors`` tensors or ``max_values`` values.
    """
    if count * MIN_ENTRY > end - start:
        return None  # an implausible count: corrupt or hostile, the checks after the CRC say
    check_limit(count, max_tensors, "tensors", "max_tensors")
    try:
        return _parse_entries(view, count, start, end, max_values, version)
    except PayloadLimitError:
        raise
    except PayloadError:
        return None


def _check_count(count: int, body_size: int) -> None:
    if count > MAX_TENSORS or count * MIN_ENTRY > body_size:
        raise PayloadError(f"implausible tensor count {count}")


def _parse_entries(
    view: memoryview, count: int, start: int, end: int, max_values: int, version: int
) -> tuple[list[Entry], int]:
    kinds = KINDS_OF_VERSION[version]
    reader = _Reader(view, start, end)
    entries = []
    values = 0
    seen: set[str] = set()
    for index in range(count):
        (name_length,) = reader.unpack(NAME_LENGTH, "name length of entry {}", index)
        if name_length > MAX_NAME_BYTES:
            raise PayloadError(f"entry {index}: {name_length}-byte name exceeds {MAX_NAME_BYTES}")
        try:
            name = bytes(reader.take(name_length, "name of entry {}", index)).decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadError(f"entry {index}: name is not valid UTF-8") from None
        if name in seen:
            raise PayloadError(f"tensor name {name!r} is repeated")
        seen.add(name)
        dtype_code, kind, ndim = reader.unpack(ENTRY_CODES, "{!r} header", name)
        if dtype_code not in DTYPE_OF_CODE:
            raise PayloadError(f"tensor {name!r}: unknown dtype code {dtype_code}")
        if kind not in kinds:
            if kind in BUCKET_KINDS:
                raise PayloadError(
                    f"tensor {name!r}: kind {kind} (scale buckets) needs format version "
                    f"{BUCKETS_VERSION}, the message is version {version}"
                )
            raise PayloadError(f"tensor {name!r}: unknown kind {kind}")
        if ndim > MAX_NDIM:
            raise PayloadError(f"tensor {name!r}: {ndim} dimensions exceed {MAX_NDIM}")
        shape = tuple(reader.unpack(SHAPE_OF_NDIM[ndim], "shape of {!r}", name))
        if any(dim > MAX_DIM for dim in shape):
            raise PayloadError(f"tensor {name!r}: a dimension of {shape} exceeds {MAX_DIM}")
        if math.prod(dim for dim in shape if dim) > MAX_SPAN:  # torch's strides fit int64
            raise PayloadError(f"tensor {name!r}: shape {shape} spans more than 2**62 values")
        values += math.prod(shape)
        check_limit(values, max_values, f"values (by tensor {name!r})", "max_values")
        scale = 0.0
        if kind != KIND_DENSE:
            (raw_scale,) = reader.unpack(SCALE, "scale of {!r}", name)
            if not math.isfinite(raw_scale):
                raise PayloadError(f"tensor {name!r}: non-finite scale {raw_scale}")
            if raw_scale < 0:
                raise PayloadError(f"tensor {name!r}: negative scale {raw_scale}")
            if kind == KIND_BASE5 and raw_scale > MAX_BASE5_SCALE:
                raise PayloadError(
                    f"tensor {name!r}: scale {raw_scale:.4g} would decode level 2 past float32"
                )
            scale = raw_scale
        bucket = 0
        if kind in BUCKET_KINDS:
            (bucket,) = reader.unpack(BUCKET, "bucket size of {!r}", name)
            if bucket < 1:
                raise PayloadError(f"tensor {name!r}: bucket size {bucket} is not >= 1")
        entries.append((name, DTYPE_OF_CODE[dtype_code], kind, shape, scale, bucket))
    return entries, reader.pos

@dataclass(frozen=True)
class Layout:
    """Where a checked message's data lies: the body, the parsed entries, where their data
    starts in the body and each entry's data size."""

    body: memoryview
    entries: list[Entry]
    start: int
    sizes: list[int]

def as_view(data: bytes | bytearray | memoryview, max_bytes: int) -> memoryview:
    """``data`` as a flat byte view, refused when longer than ``max_bytes``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as error:
        raise PayloadError(f"data is not a flat byte buffer: {error}") from None
    if len(view) > max_bytes:
        raise PayloadLimitError(
            f"message of {len(view)} bytes exceeds the limit of {max_bytes} "
            f"(max_bytes; pass a larger max_bytes= to accept more)"
        )
    return view


def _check_entropy_head(frame: EntropyFrame, max_tensors: int, max_values: int) -> None:
    """Refuse an entropy-coded body over ``max_tensors`` / ``max_values`` from the start of
    its body, the entries' headers, before the rest (the tensors' data) is decompressed."""
    (count,) = COUNT.unpack_from(frame.head(COUNT.size))
    check_limit(count, max_tensors, "tensors", "max_tensors")
    head = frame.head(COUNT.size + count * MAX_ENTRY)
    _parse_entries(head, count, COUNT.size, len(head), max_values, FORMAT_VERSION)


def validated_entries(
    view: memoryview, max_tensors: int, max_values: int, max_bytes: int
) -> tuple[memoryview, list[Entry], int, list[int]]:
    """The body holding the entries, the checked entries, where their data starts in the
    body, and each entry's data size (plain ``FDTQ`` or entropy-coded ``FDTE`` messages).

    Refuses, before allocating anything for the entries, a message declaring more than
    ``max_tensors`` tensors or ``max_values`` values, or an entropy-coded body of more than
    ``max_bytes`` bytes (before decompressing it)."""
    if bytes(view[: len(ENTROPY_MAGIC)]) == ENTROPY_MAGIC:
        frame = check_entropy_coded(view, max_bytes)  # also <= MAX_EXPANSION x the message
        if frame.size < COUNT.size:
            raise PayloadError(f"entropy-coded body of {frame.size} bytes has no tensor count")
        _check_entropy_head(frame, max_tensors, max_values)
        body = frame.body()
        (count,) = COUNT.unpack_from(body)
        start, end = COUNT.size, len(body)
        parsed = None
        version = FORMAT_VERSION  # an entropy-coded body has no bucket entries
    else:
        body = view
        count, version = _read_prefix(view)
        start, end = PREFIX.size, len(view) - CRC.size
        # the limits first: a message over them is refused before its CRC is computed
        parsed = _within_limits(view, count, start, end, max_tensors, max_values, version)
        _check_crc_and_flags(view)
    _check_count(count, end - start)
    check_limit(count, max_tensors, "tensors", "max_tensors")
    if parsed is None:
        parsed = _parse_entries(body, count, start, end, max_values, version)
    entries, data_start = parsed
    sizes = [
        data_size(dtype, kind, math.prod(shape), bucket)
        for _, dtype, kind, shape, _, bucket in entries
    ]
    available = end - data_start
    if sum(sizes) != available:
        raise PayloadError(
            f"declared shapes need {sum(sizes)} data bytes but {available} are present"
        )
    return body, entries, data_start, sizes
