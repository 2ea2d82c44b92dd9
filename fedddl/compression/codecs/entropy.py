"""Entropy-coded update messages (``FDTE``): the update message's body through zstd.

A compressor whose ``entropy_coding`` is ``"zstd"`` makes
:func:`~fedddl.compression.encode_update` send this instead of the plain ``FDTQ`` message
whenever it is smaller. Byte layout (little-endian)::

    0       4     magic  b"FDTE"
    4       1     version = 1
    5       1     flags = 0 (reserved)
    6       ...   one zstd frame (RFC 8878) without its magic number, with its content
                  size, without a checksum; its content is the body
    end-4   4     u32 CRC-32 (zlib's) of every preceding byte

    body:   u32 count, then the entries and their data as in
            :mod:`fedddl.compression.codecs.wire.layout`

Decoding is bounded before anything is allocated: the content size is at most
:data:`MAX_EXPANSION` times the message size, and the frame ends exactly at the CRC.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import Any

from fedddl.compression.codecs.errors import PayloadError, PayloadLimitError
from fedddl.compression.codecs.limits import DEFAULT_MAX_BYTES
from fedddl.compression.codecs.zstd_frame import (
    check_frame_extent,
    frame_compressor,
    zstd_module,
)
from fedddl.framing import CRC, BytesLike, check_crc, check_magic, crc32, crc32_of

__all__ = [
    "MAGIC",
    "MAX_EXPANSION",
    "VERSION",
    "EntropyFrame",
    "check_entropy_coded",
    "open_entropy_coded",
    "seal_entropy_coded",
]

MAGIC = b"FDTE"
VERSION = 1
#: The body may be at most this many times the message's size (the decoder's bound).
MAX_EXPANSION = 64
_HEAD = struct.Struct("<4sBB")
_SMALL_BODY = 1 << 16
_WHAT = "entropy-coded update"
_local = threading.local()


def seal_entropy_coded(parts: Sequence[BytesLike], plain_size: int) -> bytes | None:
    """The entropy-coded message whose body is the concatenation of ``parts``, or
    ``None`` if it would not be smaller than ``plain_size`` bytes (the plain
    message) or would exceed the decoder's expansion bound."""
    body = b"".join(parts)
    level = 19 if len(body) < _SMALL_BODY else 1
    frame = frame_compressor(level).compress(body)
    size = _HEAD.size + len(frame) + CRC.size
    if size >= plain_size or len(body) > MAX_EXPANSION * size:
        return None
    head = _HEAD.pack(MAGIC, VERSION, 0)
    return b"".join([head, frame, CRC.pack(crc32_of([frame], crc32(head)))])


def open_entropy_coded(view: memoryview, max_bytes: int = DEFAULT_MAX_BYTES) -> memoryview:
    """Check an entropy-coded message and return its body (of at most ``max_bytes``).

    Raises
    ------
    PayloadError
        Truncated, wrong magic or version, CRC mismatch, a malformed frame, or a
        declared size beyond :data:`MAX_EXPANSION` times the message size or beyond
        ``max_bytes`` (refused before decompressing).
    """
    return check_entropy_coded(view, max_bytes).body()


class EntropyFrame:
    """A checked zstd frame and the size of the body it declares."""

    def __init__(self, frame: memoryview, size: int) -> None:
        self.frame, self.size = frame, size

    def head(self, count: int) -> memoryview:
        """The first ``count`` bytes of the body (all of it if shorter), decompressing no more.

        Raises
        ------
        PayloadError
            If the frame is corrupt.
        """
        zstd = zstd_module()
        wanted = min(count, self.size)
        try:
            with _decompressor().stream_reader(self.frame) as reader:
                pieces, got = [], 0
                while got < wanted:
                    piece = reader.read(wanted - got)
                    if not piece:
                        break
                    pieces.append(piece)
                    got += len(piece)
        except zstd.ZstdError as error:
            raise PayloadError(f"{_WHAT}: corrupt zstd frame ({error})") from None
        return memoryview(b"".join(pieces))

    def body(self) -> memoryview:
        """The whole body.

        Raises
        ------
        PayloadError
            If the frame is corrupt or holds another size than it declares.
        """
        zstd = zstd_module()
        try:
            body = _decompressor().decompress(self.frame, max_output_size=self.size)
        except zstd.ZstdError as error:
            raise PayloadError(f"{_WHAT}: corrupt zstd frame ({error})") from None
        if len(body) != self.size:
            raise PayloadError(f"{_WHAT}: the frame holds {len(body)} bytes, declares {self.size}")
        return memoryview(body)


def check_entropy_coded(view: memoryview, max_bytes: int = DEFAULT_MAX_BYTES) -> EntropyFrame:
    """Check an entropy-coded message as :func:`open_entropy_coded` does, decompressing
    nothing; the returned frame gives the body, or its first bytes.

    Raises
    ------
    PayloadError
        As :func:`open_entropy_coded`.
    """
    if len(view) < _HEAD.size + 1 + CRC.size:
        raise PayloadError(f"{_WHAT}: truncated: {len(view)} bytes")
    magic, version, flags = _HEAD.unpack_from(view)
    check_magic(
        _WHAT, magic, version, expected_magic=MAGIC, expected_version=VERSION, error=PayloadError
    )
    end = len(view) - CRC.size
    (crc,) = CRC.unpack_from(view, end)
    check_crc(_WHAT, view[:end], crc, error=PayloadError)
    if flags != 0:
        raise PayloadError(f"{_WHAT}: unknown flags {flags:#x}")
    frame = view[_HEAD.size : end]
    zstd = zstd_module()
    try:
        declared = zstd.get_frame_parameters(frame, format=zstd.FORMAT_ZSTD1_MAGICLESS)
    except zstd.ZstdError as error:
        raise PayloadError(f"{_WHAT}: bad zstd frame header ({error})") from None
    size = declared.content_size
    if size == zstd.CONTENTSIZE_UNKNOWN or size > MAX_EXPANSION * len(view):
        raise PayloadError(
            f"{_WHAT}: the frame declares {size} bytes of content, more than "
            f"{MAX_EXPANSION} x the {len(view)}-byte message (or none)"
        )
    if size > max_bytes:
        raise PayloadLimitError(
            f"{_WHAT}: the frame declares {size} bytes of content, more than the limit "
            f"max_bytes={max_bytes} (pass a larger max_bytes= to accept more)"
        )
    check_frame_extent(_WHAT, frame)
    return EntropyFrame(frame, int(size))


def _decompressor() -> Any:
    cached = getattr(_local, "decompressor", None)
    if cached is None:
        zstd = zstd_module()
        cached = zstd.ZstdDecompressor(format=zstd.FORMAT_ZSTD1_MAGICLESS)
        _local.decompressor = cached
    return cached
