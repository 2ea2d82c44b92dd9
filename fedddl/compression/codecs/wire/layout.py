"""The byte layout of an update message (``FDTQ``) and its constants.

Byte layout (versions 1 and 2, all integers little-endian)::

    offset  size  field
    0       4     magic  b"FDTQ"
    4       1     version: 1, or 2 when an entry has scale buckets (kinds 3 and 4)
    5       1     flags = 0 (reserved)
    6       4     u32 count: number of tensors (<= MAX_TENSORS)
    10      8     u64 total length of the message in bytes, CRC included
    18      ...   count entries, each:
                    u16  name length L (<= MAX_NAME_BYTES), then L bytes UTF-8 name
                    u8   dtype: 1 float32, 2 float64, 3 float16, 4 bfloat16
                    u8   kind:  0 dense, 1 ternary 2-bit, 2 ternary base-3,
                                (version 2 only) 3 2-bit with buckets, 4 base-3 with buckets,
                                5 five-level base-5 (one scale)
                    u8   ndim (<= MAX_NDIM), then ndim x u64 dims (each <= MAX_DIM)
                    f32  scale s (ternary kinds only; finite, >= 0)
                    u32  bucket size N >= 1 (kinds 3 and 4 only)
    ...     ...   data of every entry, in entry order:
                    dense:    numel * itemsize raw bytes of the dtype
                    2-bit:    ceil(numel / 4) bytes, 4 codes per byte
                    base-3:   ceil(numel / 5) bytes, 5 codes per byte
                    base-5:   ceil(7 * ceil(numel / 3) / 8) bytes, 3 codes per 7 bits
                    kinds 3, 4: ceil(numel / N) f32 bucket scales s_b (finite, >= 0,
                              their maximum is s), then the codes as for kinds 1, 2
                  (code layout: :mod:`fedddl.compression.backends.packing`)
    end-4   4     u32 zlib.crc32 of every preceding byte

A message without bucket entries is written as version 1 (byte for byte what it always
was); a version-1 message declaring kind 3 or 4 is refused. An ``FDTE`` message
(:mod:`fedddl.compression.codecs.entropy`) carries the same count, entries and data
zstd-coded, kinds 0, 1, 2 and 5 (no buckets). Kind 5 is new with five-level codes;
decoders before it refuse such a message (unknown kind) whole. Data sizes follow from the
header alone; a coded entry decodes to ``s * code`` (``s_b * code`` for a value of bucket
``b``) computed in float32, then cast to ``dtype``.
"""

from __future__ import annotations

import struct

import torch

from fedddl.compression.backends.packing import packed_size

__all__ = [
    "BUCKETS_VERSION",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_DIM",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "MAX_TENSORS",
]

MAGIC = b"FDTQ"
FORMAT_VERSION = 1  # messages without bucket entries
BUCKETS_VERSION = 2  # messages with at least one entry of kind 3 or 4
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 1024
MAX_NDIM = 16
MAX_DIM = 1 << 48  # torch shapes are int64; no real tensor comes near this

PREFIX = struct.Struct("<4sBBIQ")
MAX_SPAN = 1 << 62  # product of the non-zero dimensions (even of an empty tensor)
COUNT = struct.Struct("<I")  # the tensor count that opens an entropy-coded body
MIN_ENTRY = 2 + 3  # empty name, dtype, kind, ndim
KIND_DENSE, KIND_2BIT, KIND_BASE3 = 0, 1, 2
KIND_2BIT_BUCKETS, KIND_BASE3_BUCKETS = 3, 4
KIND_BASE5 = 5
KIND_OF_CODEC = {"2bit": KIND_2BIT, "base3": KIND_BASE3, "base5": KIND_BASE5}
BUCKET_KIND_OF_CODEC = {"2bit": KIND_2BIT_BUCKETS, "base3": KIND_BASE3_BUCKETS}
CODEC_OF_KIND = {
    **{v: k for k, v in KIND_OF_CODEC.items()},
    **{v: k for k, v in BUCKET_KIND_OF_CODEC.items()},
}
BUCKET_KINDS = frozenset(BUCKET_KIND_OF_CODEC.values())
#: The kinds each format version may declare.
KINDS_OF_VERSION = {
    FORMAT_VERSION: frozenset({KIND_DENSE, KIND_2BIT, KIND_BASE3, KIND_BASE5}),
    BUCKETS_VERSION: frozenset({KIND_DENSE, KIND_2BIT, KIND_BASE3, KIND_BASE5}) | BUCKET_KINDS,
}
BUCKET = struct.Struct("<I")
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
}
DTYPE_OF_CODE = {v: k for k, v in DTYPE_CODES.items()}
NAME_LENGTH = struct.Struct("<H")
ENTRY_CODES = struct.Struct("<BBB")
SCALE = struct.Struct("<f")
SHAPE_OF_NDIM = tuple(struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1))

#: ``(name, dtype, kind, shape, scale, bucket)`` of a checked entry, in message order
#: (``bucket`` 0 but for kinds 3 and 4).
Entry = tuple[str, torch.dtype, int, tuple[int, ...], float, int]


def bucket_scale_bytes(numel: int, bucket: int) -> int:
    """Bytes of the bucket scales of an entry (0 without buckets)."""
    return 4 * -(-numel // bucket) if bucket else 0


def data_size(dtype: torch.dtype, kind: int, numel: int, bucket: int = 0) -> int:
    """Bytes of an entry's data, from its header alone."""
    if kind == KIND_DENSE:
        return numel * dtype.itemsize
    return bucket_scale_bytes(numel, bucket) + packed_size(numel, CODEC_OF_KIND[kind])
