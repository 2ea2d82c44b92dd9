"""The count-delta message (``FDGC``): a grid catch-up, entropy coded.

Byte layout (little-endian)::

    0       4     magic  b"FDGC"
    4       1     version = 1
    5       1     flags = 0 (reserved)
    6       4     u32 layout digest: CRC-32 of the tensor names and shapes (layout_digest)
    10      2     u16 tensor count T
    12      2     u16 segment count S
    14      4     u32 from version
    18      4     u32 to version
    22      4     u32 body size B
    26      ...   one magic-less zstd frame with its content size: the B-byte body
    end-4   4     u32 CRC-32 (zlib's) of every preceding byte

    body:   S segment heads, each u8 rebase (0 or 1) then T x (i16 unit, u8 bits),
            then the deltas, segment by segment and tensor by tensor in layout order,
            each ceil(numel x bits / 8) bytes (:mod:`.count_widths`; 0 bits: all zero).

Each tensor's width is the narrowest of 0, 2, 4, 8, 16, 32 bits a value that holds its
deltas (packing small ranges densely helps zstd: its literals cost at least a bit). Decoding is
all or nothing and bounded before anything is decompressed: the body may be at most
``max_bytes`` and at most what ``S`` segments of the expected layout can need.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fedddl.compression.codecs.count_delta import (
    MAX_DELTA,
    MAX_EXPONENT,
    MIN_EXPONENT,
    CountDelta,
    CountSegment,
    Layout,
)
from fedddl.compression.codecs.count_widths import (
    WIDTHS,
    narrowest_width,
    pack_integers,
    packed_bytes,
    unpack_integers,
)
from fedddl.compression.codecs.errors import PayloadError
from fedddl.compression.codecs.zstd_frame import compress_frame, open_frame
from fedddl.framing import CRC, BytesLike, check_magic, crc32, seal, unseal

__all__ = ["MAGIC", "VERSION", "decode_counts", "encode_counts", "layout_digest"]

MAGIC = b"FDGC"
VERSION = 1
_HEAD = struct.Struct("<4sBBIHHIII")
_SEGMENT = struct.Struct("<B")
_TENSOR = struct.Struct("<hB")
_WHAT = "count delta"
_SMALL_BODY = 1 << 16
_U32 = 1 << 32


def layout_digest(layout: Layout) -> int:
    """CRC-32 of the names (UTF-8, NUL-ended) and shapes (u32 rank, u32 sizes), in order."""
    parts = bytearray()
    for name, shape in layout.items():
        parts += name.encode() + b"\0" + struct.pack(f"<I{len(shape)}I", len(shape), *shape)
    return crc32(bytes(parts))


def _check_segment(segment: CountSegment, layout: Layout) -> None:
    if segment.layout() != dict(layout) or list(segment.units) != list(layout):
        raise ValueError(f"{_WHAT}: a segment's tensors {segment.layout()} are not {dict(layout)}")
    for name, delta in segment.deltas.items():
        unit = segment.units[name]
        if not MIN_EXPONENT <= unit <= MAX_EXPONENT:
            raise ValueError(f"{_WHAT}: {name!r} has unit {unit}, out of range")
        if delta.numel() and int(delta.to(torch.int64).abs().max()) > MAX_DELTA:
            raise ValueError(f"{_WHAT}: {name!r} has a delta beyond {MAX_DELTA}")


def encode_counts(delta: CountDelta, layout: Layout | None = None) -> bytes:
    """Serialise ``delta``; ``layout`` defaults to its first segment's (needed if it has none).

    Raises
    ------
    ValueError
        Segments that do not match the layout, units or deltas out of range, versions
        outside u32, or more than 65535 tensors or segments.
    """
    if layout is None:
        if not delta.segments:
            raise ValueError(f"{_WHAT}: an empty delta needs its layout")
        layout = delta.segments[0].layout()
    if len(layout) >= 1 << 16 or len(delta.segments) >= 1 << 16:
        raise ValueError(f"{_WHAT}: too many tensors or segments")
    if not (0 <= delta.from_version <= delta.to_version < _U32):
        raise ValueError(f"{_WHAT}: versions {delta.from_version} -> {delta.to_version}")
    heads = bytearray()
    data: list[bytes] = []
    for segment in delta.segments:
        _check_segment(segment, layout)
        heads += _SEGMENT.pack(int(segment.rebase))
        for name in layout:
            values = segment.deltas[name].detach().to(device="cpu", dtype=torch.int64)
            bits = narrowest_width(values)
            heads += _TENSOR.pack(segment.units[name], bits)
            data.append(pack_integers(values, bits))
    body = bytes(heads) + b"".join(data)
    head = _HEAD.pack(
        MAGIC, VERSION, 0, layout_digest(layout), len(layout), len(delta.segments),
        delta.from_version, delta.to_version, len(body),
    )  # fmt: skip
    level = 19 if len(body) < _SMALL_BODY else 1  # as fast as it is good on big bodies
    return seal(head + compress_frame(body, level))


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def decode_counts(data: BytesLike, layout: Layout, max_bytes: int) -> CountDelta:
    """Check and decode a count-delta message for tensors of ``layout``.

    Raises
    ------
    PayloadError
        Naming the problem: truncation, bad magic, version, flags or CRC, a layout other
        than the expected one, a body over ``max_bytes`` or over what its segments can
        need, a malformed zstd frame, a bad rebase flag, width or unit, deltas beyond
        ``MAX_DELTA``, or a body whose size does not add up.
    """
    view = memoryview(data)
    if len(view) > max_bytes:
        raise PayloadError(f"{_WHAT}: {len(view)} bytes, over the limit of {max_bytes}")
    if len(view) < _HEAD.size + 1 + CRC.size:
        raise PayloadError(f"{_WHAT}: truncated: {len(view)} bytes")
    magic, version, flags, digest, tensors, count, first, last, size = _HEAD.unpack_from(view)
    check_magic(_WHAT, magic, version, expected_magic=MAGIC, expected_version=VERSION,
                error=PayloadError)  # fmt: skip
    body_view = unseal(_WHAT, view, error=PayloadError)
    if flags != 0:
        raise PayloadError(f"{_WHAT}: unknown flags {flags:#x}")
    if tensors != len(layout) or digest != layout_digest(layout):
        raise PayloadError(
            f"{_WHAT}: the tensor names and shapes ({tensors} tensors, digest {digest:#010x}) "
            f"are not the expected layout's ({len(layout)}, {layout_digest(layout):#010x})"
        )
    if first > last:
        raise PayloadError(f"{_WHAT}: from version {first} is after to version {last}")
    numels = [_numel(shape) for shape in layout.values()]
    head_size = _SEGMENT.size + _TENSOR.size * len(layout)
    most = count * (head_size + 4 * sum(numels))
    if size > max_bytes or size > most:
        raise PayloadError(
            f"{_WHAT}: declares a {size}-byte body, over the limit of {min(max_bytes, most)}"
        )
    body = memoryview(open_frame(_WHAT, body_view[_HEAD.size :], size))
    return CountDelta(first, last, _segments(body, layout, numels, count))


def _segments(
    body: memoryview, layout: Layout, numels: list[int], count: int
) -> tuple[CountSegment, ...]:
    heads: list[tuple[bool, list[tuple[int, int]]]] = []
    if count * (_SEGMENT.size + _TENSOR.size * len(layout)) > len(body):
        raise PayloadError(f"{_WHAT}: the body holds {len(body)} bytes, too few for {count} heads")
    position = 0
    needed = 0
    for index in range(count):
        (rebase,) = _SEGMENT.unpack_from(body, position)
        position += _SEGMENT.size
        if rebase > 1:
            raise PayloadError(f"{_WHAT}: segment {index} has rebase flag {rebase}")
        entries = []
        for name, numel in zip(layout, numels, strict=True):
            unit, width = _TENSOR.unpack_from(body, position)
            position += _TENSOR.size
            if width not in WIDTHS:
                raise PayloadError(f"{_WHAT}: segment {index} {name!r} has width {width} bits")
            if not MIN_EXPONENT <= unit <= MAX_EXPONENT:
                raise PayloadError(
                    f"{_WHAT}: segment {index} {name!r} has unit {unit}, outside "
                    f"[{MIN_EXPONENT}, {MAX_EXPONENT}]"
                )
            entries.append((unit, width))
            needed += packed_bytes(numel, width)
        heads.append((bool(rebase), entries))
    if position + needed != len(body):
        raise PayloadError(
            f"{_WHAT}: the body holds {len(body)} bytes, its heads need {position + needed}"
        )
    segments = []
    for index, (rebase, entries) in enumerate(heads):
        units: dict[str, int] = {}
        deltas: dict[str, torch.Tensor] = {}
        for (name, shape), numel, (unit, width) in zip(
            layout.items(), numels, entries, strict=True
        ):
            size = packed_bytes(numel, width)
            values = unpack_integers(body[position : position + size], numel, width)
            position += size
            if isinstance(values, str):
                raise PayloadError(f"{_WHAT}: segment {index} {name!r}: {values}")
            if numel and int(np.abs(values.astype(np.int64)).max()) > MAX_DELTA:
                raise PayloadError(
                    f"{_WHAT}: segment {index} {name!r} has a delta beyond {MAX_DELTA}"
                )
            units[name] = unit
            deltas[name] = torch.from_numpy(values).reshape(shape)
        segments.append(CountSegment(rebase=rebase, units=units, deltas=deltas))
    return tuple(segments)
