"""Bounded zstd frames: compress a body, and open a frame only up to a size known in advance.

The frames are magic-less zstd frames (RFC 8878) with their content size and without a
checksum or dictionary id. :func:`open_frame` refuses a frame whose declared content size
is not the expected one or that does not end exactly where the given bytes end, and never
decompresses more than that size: a small message cannot expand into a large allocation.
"""

from __future__ import annotations

import threading
from typing import Any

from fedddl.compression.codecs.errors import PayloadError
from fedddl.framing import BytesLike

__all__ = ["check_frame_extent", "compress_frame", "frame_compressor", "open_frame", "zstd_module"]

_local = threading.local()


def zstd_module() -> Any:
    """The ``zstandard`` module (a dependency; a clear ImportError if it is missing)."""
    try:
        import zstandard
    except ImportError as error:  # pragma: no cover - zstandard is a dependency
        raise ImportError(
            "zstd frames need the zstandard package (pip install zstandard)"
        ) from error
    return zstandard


def frame_compressor(level: int) -> Any:
    """A zstd compressor of magic-less frames with their content size, one per thread and
    level (instances are not thread-safe)."""
    cache: dict[int, Any] = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        zstd = zstd_module()
        params = zstd.ZstdCompressionParameters.from_level(
            level,
            format=zstd.FORMAT_ZSTD1_MAGICLESS,
            write_content_size=True,
            write_checksum=False,
            write_dict_id=False,
        )
        cache[level] = zstd.ZstdCompressor(compression_params=params)
    return cache[level]


def compress_frame(body: BytesLike, level: int = 19) -> bytes:
    """``body`` as one magic-less zstd frame with its content size."""
    return bytes(frame_compressor(level).compress(bytes(body)))


def _header_size(what: str, frame: memoryview) -> tuple[int, bool]:
    if len(frame) < 1:
        raise PayloadError(f"{what}: the zstd frame is empty")
    descriptor = frame[0]
    if descriptor & 0b1000:
        raise PayloadError(f"{what}: the zstd frame header sets a reserved bit")
    content_flag, single_segment = descriptor >> 6, (descriptor >> 5) & 1
    content_bytes = (single_segment, 2, 4, 8)[content_flag]
    dictionary_bytes = (0, 1, 2, 4)[descriptor & 0b11]
    return 1 + (1 - single_segment) + dictionary_bytes + content_bytes, bool(descriptor & 0b100)


def check_frame_extent(what: str, frame: memoryview) -> None:
    """Walk the block headers: the frame must end exactly where ``frame`` ends (else a
    :class:`PayloadError` naming ``what``)."""
    position, checksum = _header_size(what, frame)
    while True:
        if position + 3 > len(frame):
            raise PayloadError(f"{what}: the zstd frame is truncated")
        header = int.from_bytes(frame[position : position + 3], "little")
        kind, size = (header >> 1) & 0b11, header >> 3
        if kind == 3:
            raise PayloadError(f"{what}: reserved zstd block type")
        position += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
        if header & 1:
            break
    position += 4 if checksum else 0
    if position != len(frame):
        raise PayloadError(f"{what}: the zstd frame ends at byte {position} of {len(frame)}")


def open_frame(what: str, frame: BytesLike, size: int) -> bytes:
    """The content of ``frame``, which must declare and hold exactly ``size`` bytes.

    Raises
    ------
    PayloadError
        A malformed frame, a declared content size other than ``size``, bytes after the
        frame, or content that is not ``size`` bytes.
    """
    view = memoryview(frame)
    zstd = zstd_module()
    try:
        declared = zstd.get_frame_parameters(view, format=zstd.FORMAT_ZSTD1_MAGICLESS)
    except zstd.ZstdError as error:
        raise PayloadError(f"{what}: bad zstd frame header ({error})") from None
    if declared.content_size != size:
        shown = (
            "none" if declared.content_size == zstd.CONTENTSIZE_UNKNOWN else declared.content_size
        )
        raise PayloadError(f"{what}: the zstd frame declares {shown} bytes, expected {size}")
    check_frame_extent(what, view)
    decompressor = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = zstd.ZstdDecompressor(format=zstd.FORMAT_ZSTD1_MAGICLESS)
        _local.decompressor = decompressor
    try:
        body = decompressor.decompress(view, max_output_size=size)
    except zstd.ZstdError as error:
        raise PayloadError(f"{what}: corrupt zstd frame ({error})") from None
    if len(body) != size:
        raise PayloadError(f"{what}: the zstd frame holds {len(body)} bytes, declares {size}")
    return bytes(body)
