"""Header and checksum checks shared by fedddl's binary formats.

Every fedddl byte format opens with a magic tag and a format version and, except the
checkpoint file (which carries a SHA-256 of its body), ends with or carries a CRC-32:

========================================  ===============================================
format                                    module
========================================  ===============================================
compressed update (``FDTQ``)              :mod:`fedddl.compression.wire`
shared-scale-sum downlink (``S``)         :mod:`fedddl.compression.downlink`
gossip frame (``FGSP``)                   :mod:`fedddl.gossip.wire`
server checkpoint (``FDDLCKPT``)          :mod:`fedddl.checkpoint`
========================================  ===============================================

The helpers below raise the caller's own error class (``PayloadError``, ``WireError``,
``CheckpointError``), so each format keeps one error type, with the same wording.

The CRC-32 is zlib's (``zlib.crc32``); :func:`crc32` computes the same value with
ISA-L's carry-less-multiply code when the ``isal`` package is installed (several
times faster on large messages), else with ``zlib.crc32``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from typing import TypeAlias

__all__ = [
    "CRC",
    "BytesLike",
    "check_crc",
    "check_magic",
    "crc32",
    "crc32_of",
    "seal",
    "unseal",
]

BytesLike: TypeAlias = bytes | bytearray | memoryview

#: A little-endian ``u32`` CRC-32 (``zlib.crc32``).
CRC = struct.Struct("<I")

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same value
    _crc32 = zlib.crc32


def crc32(data: BytesLike, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, computed by ISA-L when it is installed."""
    return int(_crc32(data, value))


def check_magic(
    what: str,
    magic: BytesLike,
    version: int,
    *,
    expected_magic: bytes,
    expected_version: int,
    error: type[Exception],
) -> None:
    """Raise ``error`` unless ``magic`` and ``version`` are the expected ones.

    Raises
    ------
    error
        ``"<what>: bad magic ..."`` or ``"<what>: unsupported format version ..."``.
    """
    if bytes(magic) != expected_magic:
        raise error(f"{what}: bad magic {bytes(magic)!r}, expected {expected_magic!r}")
    if version != expected_version:
        raise error(
            f"{what}: unsupported format version {version}, expected {expected_version}"
        )


def crc32_of(parts: Iterable[BytesLike], start: int = 0) -> int:
    """CRC-32 of the concatenation of ``parts`` (without concatenating them)."""
    crc = start
    for part in parts:
        crc = crc32(part, crc)
    return crc


def check_crc(what: str, data: BytesLike, expected: int, *, error: type[Exception]) -> None:
    """Raise ``error`` (``"<what>: checksum mismatch ..."``) unless the CRC-32 matches."""
    if crc32(data) != expected:
        raise error(f"{what}: checksum mismatch (CRC-32): the data is corrupted")


def seal(body: bytes) -> bytes:
    """Return ``body`` followed by its :data:`CRC`."""
    return body + CRC.pack(crc32(body))


def unseal(what: str, data: BytesLike, *, error: type[Exception]) -> memoryview:
    """Check the trailing :data:`CRC` written by :func:`seal`; return the body (a view).

    Raises
    ------
    error
        If ``data`` is shorter than the CRC or the CRC does not match.
    """
    view = memoryview(data)
    if len(view) < CRC.size:
        raise error(f"{what}: truncated: {len(view)} bytes, shorter than its checksum")
    body = view[: len(view) - CRC.size]
    (crc,) = CRC.unpack_from(view, len(view) - CRC.size)
    check_crc(what, body, crc, error=error)
    return body
