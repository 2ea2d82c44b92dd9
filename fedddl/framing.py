"""Header and checksum checks shared by fedddl's binary formats.

Every fedddl byte format opens with a magic tag and a format version and, except the
checkpoint file (which carries a SHA-256 of its body), ends with or carries a CRC-32:

========================================  ===============================================
format                                    module
========================================  ===============================================
compressed update (``FDTQ``)              :mod:`fedddl.compression.codecs.wire`
shared-scale-sum downlink (``S``)         :mod:`fedddl.compression.codecs.downlink`
gossip frame (``FGSP``)                   :mod:`fedddl.gossip.wire`
server checkpoint (``FDDLCKPT``)          :mod:`fedddl.checkpoint`
========================================  ===============================================

The helpers below raise the caller's own error class (``PayloadError``, ``WireError``,
``CheckpointError``), so each format keeps one error type, with the same wording.

The CRC-32 is zlib's (``zlib.crc32``); :func:`crc32` computes the same value with
ISA-L's carry-less-multiply code when the ``isal`` package is installed, else with
``zlib.crc32``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable
from typing import TypeAlias

__all__ = [
    "CRC",
    "BytesLike",
    "check_crc",
    "check_magic",
    "crc32",
    "crc32_combine",
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


_ZERO_BYTE_OPERATORS: list[list[int]] = []  # [k]: appending 2**k zero bytes, as GF(2) rows


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _zero_byte_operators() -> list[list[int]]:
    """zlib's ``crc32_combine`` operators (one 32x32 GF(2) matrix per power of two of
    zero bytes appended), computed once per process."""
    if not _ZERO_BYTE_OPERATORS:
        one_bit = [0xEDB88320] + [1 << (n - 1) for n in range(1, 32)]
        operator = one_bit
        for _ in range(3):  # 2, 4, 8 zero bits
            operator = [_gf2_times(operator, row) for row in operator]
        operators = [operator]
        for _ in range(47):  # up to 2**47 bytes
            operators.append([_gf2_times(operators[-1], row) for row in operators[-1]])
        _ZERO_BYTE_OPERATORS[:] = operators
    return _ZERO_BYTE_OPERATORS


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len(B)``
    (zlib's ``crc32_combine``, which Python's ``zlib`` does not expose): pieces of a
    message checksummed on several threads give the message's CRC."""
    if length2 < 0:
        raise ValueError(f"length2 must be >= 0, got {length2}")
    operators = _zero_byte_operators()
    power = 0
    while length2:
        if length2 & 1:
            crc1 = _gf2_times(operators[power], crc1)
        length2 >>= 1
        power += 1
    return crc1 ^ crc2


def crc32_of(parts: Iterable[BytesLike], start: int = 0) -> int:
    """CRC-32 of the concatenation of ``parts`` (without concatenating them)."""
    crc = start
    for part in parts:
        crc = crc32(part, crc)
    return crc


def check_crc(
    what: str,
    data: BytesLike,
    expected: int,
    *,
    error: type[Exception],
    checksum: Callable[[BytesLike], int] | None = None,
) -> None:
    """Raise ``error`` (``"<what>: checksum mismatch ..."``) unless the CRC-32 matches;
    ``checksum`` computes it (default :func:`crc32`; e.g. a threaded one)."""
    if (checksum or crc32)(data) != expected:
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
