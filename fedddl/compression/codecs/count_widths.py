"""Integers at the narrowest of 0, 2, 4, 8, 16 or 32 bits a value, for the count-delta message.

========  ==========================================================================
bits      values and layout (little-endian, value ``i`` first)
========  ==========================================================================
0         all zero; no bytes
2         ``-1, 0, 1`` as the ternary codes of :mod:`fedddl.compression.backends.packing`
          (``"2bit"``: 0 -> 0, 1 -> +1, 2 -> -1; four a byte)
4         ``-8 .. 7`` as two's-complement nibbles, value ``2j`` in the low nibble of byte ``j``
8/16/32   signed integers
========  ==========================================================================

Unused trailing bits of the last byte must be zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedddl.compression.backends.packing import find_invalid_codes, pack_codes
from fedddl.compression.backends.unpacking import unpack_codes

__all__ = ["WIDTHS", "narrowest_width", "pack_integers", "packed_bytes", "unpack_integers"]

#: Bits a value, of every width.
WIDTHS = (0, 2, 4, 8, 16, 32)
_SIGNED: dict[int, np.dtype[Any]] = {8: np.dtype("<i1"), 16: np.dtype("<i2"), 32: np.dtype("<i4")}


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` values at ``bits`` a value."""
    return -(-numel * bits // 8)


def narrowest_width(values: torch.Tensor) -> int:
    """The fewest bits a value that hold every one of ``values`` (integers within int32)."""
    if values.numel() == 0:
        return 0
    low, high = int(values.min()), int(values.max())
    if low == 0 and high == 0:
        return 0
    if low >= -1 and high <= 1:
        return 2
    for bits in (4, 8, 16):
        if -(1 << (bits - 1)) <= low and high < 1 << (bits - 1):
            return bits
    return 32


def pack_integers(values: torch.Tensor, bits: int) -> bytes:
    """``values`` (1-D integers that fit ``bits``) packed at ``bits`` a value."""
    flat = values.to(torch.int64).reshape(-1)
    if bits == 0:
        return b""
    if bits == 2:
        return bytes(pack_codes(torch.remainder(flat, 3).to(torch.uint8), "2bit").numpy())
    if bits == 4:
        nibbles = (flat.numpy() & 0xF).astype(np.uint8)
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        return bytes(nibbles[0::2] | (nibbles[1::2] << 4))
    return bytes(flat.numpy().astype(_SIGNED[bits]).tobytes())


def unpack_integers(data: memoryview, numel: int, bits: int) -> np.ndarray[Any, Any] | str:
    """``numel`` int32 values from ``packed_bytes(numel, bits)`` bytes, or what is wrong."""
    if bits == 0:
        return np.zeros(numel, dtype=np.int32)
    raw = np.frombuffer(data, dtype=np.uint8)
    if bits == 2:
        packed = torch.from_numpy(raw.copy())
        problem = find_invalid_codes(packed, numel, "2bit")
        if problem is not None:
            return problem
        return unpack_codes(packed, numel, 1.0, "2bit").numpy().astype(np.int32)
    if bits == 4:
        nibbles = np.empty(raw.size * 2, dtype=np.int32)
        nibbles[0::2], nibbles[1::2] = raw & 0xF, raw >> 4
        if nibbles[numel:].any():
            return "nonzero padding after the last 4-bit value"
        values = nibbles[:numel]
        return np.where(values >= 8, values - 16, values).astype(np.int32)
    signed: np.ndarray[Any, Any] = np.frombuffer(data, dtype=_SIGNED[bits], count=numel)
    return signed.astype(np.int32)
