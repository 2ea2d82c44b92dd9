"""Packing of ternary codes into bytes, and the lookup tables that unpack them.

Codes
-----
Each value is a 2-bit code: ``0b00`` = 0, ``0b01`` = +1, ``0b10`` = -1;
``0b11`` is invalid.

``"2bit"`` codec (4 values per byte, 2 bits per value)
    Value ``i`` lives in byte ``i // 4`` at bits ``2*(i % 4)`` and
    ``2*(i % 4) + 1`` (value 0 in the least significant bits). The unused
    trailing code slots of the last byte must be ``0b00``.

``"base3"`` codec (5 values per byte, 1.6 bits per value)
    Each code is a trit ``t`` (``0``, ``1`` = +1, ``2`` = -1, the same numbers
    as the 2-bit codes); byte ``j`` holds values ``5j .. 5j+4`` as
    ``t0 + 3*t1 + 9*t2 + 27*t3 + 81*t4`` (so bytes ``243..255`` are invalid).
    The unused trailing trits of the last byte must be 0.

Both directions are vectorised: packing uses integer shifts on ``uint32`` views
(4 code bytes -> 1 byte), unpacking is a gather from a 256-entry table that
already holds ``scale * value`` (4 or 5 floats per entry; the 4 floats of the
2-bit table are gathered as one 16-byte ``complex128``).
The host must be little-endian (checked at import).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

__all__ = [
    "CODECS",
    "CODE_MINUS",
    "CODE_PLUS",
    "CODE_ZERO",
    "codes_per_byte",
    "find_invalid_codes",
    "pack_codes",
    "pack_codes_into",
    "packed_size",
    "unpack_codes",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is LE
    raise ImportError("fedddl.compression assumes a little-endian host")

CODE_ZERO = 0b00
CODE_PLUS = 0b01
CODE_MINUS = 0b10

#: Names of the packing codecs.
CODECS: tuple[str, ...] = ("2bit", "base3")

_PER_BYTE = {"2bit": 4, "base3": 5}
_VALUE_OF_CODE = (0.0, 1.0, -1.0)
_MASK_LOW_BITS = 0x5555555555555555  # bit 0 of every 2-bit slot in an int64


def codes_per_byte(codec: str) -> int:
    """How many values one byte holds under ``codec``."""
    try:
        return _PER_BYTE[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}") from None


def packed_size(numel: int, codec: str) -> int:
    """Bytes needed to pack ``numel`` values with ``codec``."""
    per = codes_per_byte(codec)
    return -(-numel // per)


def _build_tables() -> dict[str, np.ndarray]:
    two_bit = np.zeros((256, 4), dtype=np.float32)
    base3 = np.zeros((256, 5), dtype=np.float32)
    for byte in range(256):
        for slot in range(4):
            code = (byte >> (2 * slot)) & 0b11
            two_bit[byte, slot] = _VALUE_OF_CODE[code] if code < 3 else 0.0
        rest = byte
        for slot in range(5):
            base3[byte, slot] = _VALUE_OF_CODE[rest % 3] if byte < 243 else 0.0
            rest //= 3
    return {"2bit": two_bit, "base3": base3}


_TABLES = _build_tables()
_UNPACK_CHUNK = 1 << 16  # packed bytes per gather: keeps the intp index small


def pack_codes_into(codes: np.ndarray, out: np.ndarray, codec: str) -> None:
    """Pack ``uint8`` codes into ``out`` (``packed_size(len(codes))`` bytes), numpy core.

    ``codes`` may be modified (it is used as scratch when padding is not needed).
    """
    per = codes_per_byte(codec)
    extra = (-codes.size) % per
    if extra:
        codes = np.concatenate([codes, np.zeros(extra, dtype=np.uint8)])
    if codec == "2bit":
        words = codes.view(np.uint32)
        # byte k of each little-endian word holds code k: shift it down to bits 2k..2k+1
        packed = words >> 6
        packed |= words
        packed |= words >> 12
        packed |= words >> 18
        np.copyto(out, packed, casting="unsafe")  # keeps the low byte
        return
    rows = codes.reshape(-1, per)
    np.multiply(rows[:, 4], 81, out=out)
    out += rows[:, 3] * np.uint8(27)
    out += rows[:, 2] * np.uint8(9)
    out += rows[:, 1] * np.uint8(3)
    out += rows[:, 0]


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
    pack_codes_into(codes.numpy().copy(), out, codec)
    return torch.from_numpy(out)


def find_invalid_codes(packed: torch.Tensor, numel: int, codec: str) -> str | None:
    """Describe the first problem in ``packed`` codes, or return ``None`` if valid.

    Checks the byte count, invalid code values (``0b11`` or bytes ``>= 243``)
    and that unused trailing slots are zero.
    """
    codes_per_byte(codec)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        return f"packed codes must be 1-D uint8, got {packed.dim()}-D {packed.dtype}"
    if packed.numel() != packed_size(numel, codec):
        return f"{packed.numel()} code bytes for {numel} values (need {packed_size(numel, codec)})"
    if numel == 0:
        return None
    source = packed.numpy()
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


def unpack_codes(
    packed: torch.Tensor, numel: int, scale: float, codec: str = "2bit"
) -> torch.Tensor:
    """Unpack codes into a 1-D float32 tensor of ``scale * value``.

    Invalid codes decode to 0; use :func:`find_invalid_codes` to reject them.
    The result never aliases ``packed``.
    """
    per = codes_per_byte(codec)
    if packed.numel() != packed_size(numel, codec):
        raise ValueError(
            f"{packed.numel()} code bytes for {numel} values (need {packed_size(numel, codec)})"
        )
    source = packed.numpy()
    table: np.ndarray[Any, Any] = _TABLES[codec] * np.float32(scale)
    out: np.ndarray[Any, Any]
    if codec == "2bit":
        # one 16-byte entry (4 float32) per byte: gather it as a single complex128
        table = table.view(np.complex128).reshape(256)
        out = np.empty(source.size, dtype=np.complex128)
    else:
        out = np.empty((source.size, per), dtype=np.float32)
    for start in range(0, source.size, _UNPACK_CHUNK):
        stop = min(start + _UNPACK_CHUNK, source.size)
        np.take(table, source[start:stop].astype(np.intp), axis=0, out=out[start:stop])
    flat = torch.from_numpy(out.reshape(-1).view(np.float32))
    return flat[:numel] if flat.numel() != numel else flat
