"""Packing of ternary codes into bytes, and the checks of packed bytes.

Each value is a code ``0`` = 0, ``1`` = +1, ``2`` = -1 (``0b11`` is invalid).

``"2bit"`` (4 values per byte)
    Value ``i`` lives in byte ``i // 4`` at bits ``2*(i % 4)`` and ``2*(i % 4) + 1``.
``"base3"`` (5 values per byte, 1.6 bits per value)
    Byte ``j`` holds values ``5j .. 5j+4`` as ``t0 + 3*t1 + 9*t2 + 27*t3 + 81*t4``
    (bytes ``243..255`` are invalid).
``"base5"`` (five levels, 3 values per 7 bits)
    Codes ``0..4`` for 0, +1, -1, +2, -2 (:mod:`.base5`, which packs and checks them;
    only :func:`packed_size` and the checks here dispatch to it).

Unused trailing slots of the last byte must be zero; the host must be little-endian
(checked at import). Unpacking: :mod:`.unpacking`.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from fedddl.compression.backends.base5 import (
    invalid_base5,
    invalid_base5_rows,
    packed_size_base5,
)

__all__ = [
    "CODECS",
    "CODE_MINUS",
    "CODE_PLUS",
    "CODE_ZERO",
    "PACK_SLACK",
    "PAYLOAD_CODECS",
    "codes_per_byte",
    "find_invalid_codes",
    "invalid_code_rows",
    "invalid_codes",
    "pack_codes",
    "pack_codes_into",
    "pack_padded_codes",
    "packed_size",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is LE
    raise ImportError("fedddl.compression assumes a little-endian host")

CODE_ZERO = 0b00
CODE_PLUS = 0b01
CODE_MINUS = 0b10

#: Names of the ternary packing codecs (what :func:`pack_codes` and ternary compressors take).
CODECS: tuple[str, ...] = ("2bit", "base3")
#: Every codec a coded payload may carry: the ternary ones and ``"base5"`` (five levels).
PAYLOAD_CODECS: tuple[str, ...] = (*CODECS, "base5")

_PER_BYTE = {"2bit": 4, "base3": 5}
_MASK_LOW_BITS = 0x5555555555555555  # bit 0 of every 2-bit slot in an int64


def codes_per_byte(codec: str) -> int:
    """How many values one byte holds under ``codec`` (a ternary codec)."""
    try:
        return _PER_BYTE[codec]
    except KeyError:
        if codec == "base5":
            raise ValueError("codec 'base5' packs 3 values in 7 bits, not per byte") from None
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}") from None


def packed_size(numel: int, codec: str) -> int:
    """Bytes needed to pack ``numel`` values with ``codec``."""
    if codec == "base5":
        return packed_size_base5(numel)
    per = codes_per_byte(codec)
    return -(-numel // per)


#: Bytes a code buffer needs past its last code for :func:`pack_padded_codes`.
PACK_SLACK = 8
# (w * _GATHER_2BIT) >> 24 of a little-endian uint32 of 4 codes c0..c3 is
# c0 + c1<<2 + c2<<4 + c3<<6: each code lands in its own slot of the top byte,
# every cross term lands in distinct lower slots or overflows, so no carries.
_GATHER_2BIT = np.uint32((1 << 24) | (1 << 18) | (1 << 12) | (1 << 6))
# (w * _GATHER_BASE3) >> 56 of a little-endian uint64 whose low 5 bytes are
# trits t0..t4 is sum(t_k * 3**k) (<= 242): the cross terms below the top byte
# are each at most 2 * (3 + 9 + 27 + 81) = 240 per byte, so nothing carries
# into it, and those above it (including the 3 bytes of the next group) overflow.
_GATHER_BASE3 = np.uint64(sum(3**k << (56 - 8 * k) for k in range(5)))


def pack_padded_codes(
    buffer: np.ndarray[Any, Any], numel: int, out: np.ndarray[Any, Any], codec: str
) -> None:
    """Pack ``buffer[:numel]`` (``uint8`` codes ``0..2``) into ``out``.

    ``buffer`` must hold at least ``numel + PACK_SLACK`` bytes; everything from
    ``buffer[numel]`` on is scratch, and the 2-bit codec also overwrites the
    codes.  ``out`` must hold :func:`packed_size` bytes.
    """
    per = codes_per_byte(codec)
    nbytes = -(-numel // per)
    if buffer.size < numel + PACK_SLACK or out.size != nbytes:
        raise ValueError("pack_padded_codes: buffer or out has the wrong size")
    if nbytes == 0:
        return
    buffer[numel : nbytes * per + 3] = 0  # padding codes (and, for base-3, the overread)
    if codec == "2bit":
        words = buffer[: nbytes * 4].view(np.uint32)
        np.multiply(words, _GATHER_2BIT, out=words)
        np.copyto(out, words.view(np.uint8)[3::4])
        return
    # one unaligned uint64 per group of 5 codes: bytes 5j .. 5j+7
    groups = as_strided(buffer[:8].view(np.uint64), shape=(nbytes,), strides=(5,))
    gathered = np.multiply(groups, _GATHER_BASE3)
    np.copyto(out, gathered.view(np.uint8)[7::8])


def pack_codes_into(codes: np.ndarray[Any, Any], out: np.ndarray[Any, Any], codec: str) -> None:
    """Pack ``uint8`` codes into ``out`` (:func:`packed_size` bytes); ``codes`` is not modified."""
    buffer = np.empty(codes.size + PACK_SLACK, dtype=np.uint8)
    buffer[: codes.size] = codes
    pack_padded_codes(buffer, codes.size, out, codec)


def pack_codes(codes: torch.Tensor, codec: str = "2bit") -> torch.Tensor:
    """Pack a 1-D ``uint8`` tensor of codes in ``{0, 1, 2}`` into bytes.

    Parameters
    ----------
    codes:
        1-D ``uint8`` codes (``CODE_ZERO``, ``CODE_PLUS``, ``CODE_MINUS``).
    codec:
        ``"2bit"`` or ``"base3"``.

    Returns
    -------
    torch.Tensor
        1-D ``uint8`` tensor of :func:`packed_size` bytes.
    """
    codes_per_byte(codec)
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise ValueError(f"codes must be a 1-D uint8 tensor, got {codes.dim()}-D {codes.dtype}")
    if bool((codes > CODE_MINUS).any()):
        raise ValueError("codes must be 0, 1 or 2")
    out = np.empty(packed_size(codes.numel(), codec), dtype=np.uint8)
    pack_codes_into(codes.numpy(), out, codec)
    return torch.from_numpy(out)


def find_invalid_codes(packed: torch.Tensor, numel: int, codec: str) -> str | None:
    """Describe the first problem in ``packed`` codes, or return ``None`` if valid.

    Checks the byte count, invalid code values (``0b11`` or bytes ``>= 243``)
    and that unused trailing slots are zero.
    """
    if codec not in PAYLOAD_CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {PAYLOAD_CODECS}")
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        return f"packed codes must be 1-D uint8, got {packed.dim()}-D {packed.dtype}"
    return invalid_codes(packed.numpy(), numel, codec)


def invalid_codes(source: np.ndarray[Any, Any], numel: int, codec: str) -> str | None:
    """:func:`find_invalid_codes` of packed codes in a 1-D ``uint8`` numpy array."""
    if codec == "base5":
        return invalid_base5(source, numel)
    if source.size != packed_size(numel, codec):
        return f"{source.size} code bytes for {numel} values (need {packed_size(numel, codec)})"
    if numel == 0:
        return None
    last = int(source[-1])
    if codec == "2bit":
        whole = source.size // 8 * 8
        words = source[:whole].view(np.uint64)
        # a slot is 0b11 iff its high bit and its low bit are both set
        if bool(((words & (words >> np.uint64(1))) & np.uint64(_MASK_LOW_BITS)).any()):
            return "invalid ternary code 0b11"
        tail = source[whole:]
        if bool(((tail & (tail >> 1)) & 0x55).any()):
            return "invalid ternary code 0b11"
        used = numel % 4
        if used and last >> (2 * used):
            return "non-zero padding in the last code byte"
        return None
    if bool((source >= 243).any()):
        return "invalid base-3 byte (>= 243)"
    used = numel % 5
    if used and last >= 3**used:
        return "non-zero padding in the last code byte"
    return None


def invalid_code_rows(rows: np.ndarray[Any, Any], numel: int, codec: str) -> bool:
    """Whether :func:`invalid_codes` finds a problem in any row of ``rows``: a 2-D
    ``uint8`` array holding one tensor's packed codes per row (the same tensor of several
    messages), checked in one pass."""
    if codec == "base5":
        return invalid_base5_rows(rows, numel)
    if rows.ndim != 2 or rows.shape[1] != packed_size(numel, codec):
        return True
    if numel == 0 or rows.shape[0] == 0:
        return False
    last = rows[:, -1]
    if codec == "2bit":
        used = numel % 4
        return bool(((rows & (rows >> 1)) & 0x55).any()) or bool(
            used and (last >> (2 * used)).any()
        )
    used = numel % 5
    return bool((rows >= 243).any()) or bool(used and (last >= 3**used).any())
