"""Slow, obviously-correct specifications that the fast code is tested against.

* :func:`python_pack` / :func:`python_unpack`: pure-Python loops over values, the
  bit-level specification of the code layouts (``2bit``, ``base3``).
* :func:`reference_codes`: the stochastic ternarisation rule with the same random
  stream, unchunked.
"""

from __future__ import annotations

import numpy as np

from fedddl.compression import PROBABILITY_BITS

__all__ = ["python_pack", "python_unpack", "reference_codes"]

_CODE_OF_SIGN = {0: 0b00, 1: 0b01, -1: 0b10}
_SIGN_OF_CODE = {0b00: 0, 0b01: 1, 0b10: -1}


def python_pack(signs: list[int], codec: str = "2bit") -> bytes:
    """Pack a list of signs ``{-1, 0, 1}`` with Python loops (the specification)."""
    out = bytearray()
    if codec == "2bit":
        for start in range(0, len(signs), 4):
            byte = 0
            for slot, sign in enumerate(signs[start : start + 4]):
                byte |= _CODE_OF_SIGN[sign] << (2 * slot)
            out.append(byte)
        return bytes(out)
    if codec == "base3":
        for start in range(0, len(signs), 5):
            byte = 0
            for slot, sign in enumerate(signs[start : start + 5]):
                byte += _CODE_OF_SIGN[sign] * 3**slot
            out.append(byte)
        return bytes(out)
    raise ValueError(f"unknown codec {codec!r}")


def python_unpack(data: bytes, numel: int, codec: str = "2bit") -> list[int]:
    """Inverse of :func:`python_pack` (raises ``ValueError`` on an invalid code)."""
    signs: list[int] = []
    for byte in data:
        if codec == "2bit":
            for slot in range(4):
                code = (byte >> (2 * slot)) & 0b11
                if code == 0b11:
                    raise ValueError("invalid code 0b11")
                signs.append(_SIGN_OF_CODE[code])
        else:
            if byte >= 243:
                raise ValueError("invalid base-3 byte")
            for _ in range(5):
                signs.append(_SIGN_OF_CODE[byte % 3])
                byte //= 3
    return signs[:numel]


def reference_codes(
    values: np.ndarray, scale: float, seed: int, clip_bound: float | None = None
) -> list[int]:
    """Signs the stochastic ternariser must produce for float32 ``values`` on a fresh
    ``seed``: fire iff ``r < min(|g|, clip) * (2**16 / s) - 1/2`` in float32 arithmetic."""
    flat = np.asarray(values, dtype=np.float32).reshape(-1)
    words = -(-flat.size // 4)
    rand = np.random.PCG64DXSM(seed).random_raw(words).view(np.uint16)[: flat.size]
    factor = np.float32(float(1 << PROBABILITY_BITS) / scale)
    signs = []
    for g, r in zip(flat.tolist(), rand.tolist(), strict=True):
        level = np.float32(abs(np.float32(g))) * factor
        if clip_bound is not None and clip_bound < scale:
            level = min(level, np.float32(np.float32(clip_bound) * factor))
        level = np.float32(level - np.float32(0.5))
        fire = r < level
        signs.append((-1 if np.signbit(np.float32(g)) else 1) if fire else 0)
    return signs
