"""Slow, obviously-correct reference implementations, for tests and benchmarks.

* :func:`naive_ternarize` / :func:`naive_pack`: TernGrad written the plain way
  (``torch.rand`` floats, one shift per slot): the baseline of ``fedddl bench``.
* :func:`python_pack` / :func:`python_unpack`: pure-Python loops over values,
  the bit-level specification the fast packer is checked against.
* :func:`reference_codes`: the stochastic rule of
  :mod:`fedddl.compression.ternarize` with the same random stream, unchunked.
* :func:`grace_terngrad_compress` / :func:`grace_terngrad_decompress`: TernGrad
  as the GRACE framework implements it (Xu et al., "GRACE: A Compressed
  Communication Framework for Distributed Machine Learning", ICDCS 2021; its
  PyTorch ``TernGradCompressor``): the same sequence of tensor operations, for
  the speed comparisons of ``fedddl bench compression``.
"""

from __future__ import annotations

import numpy as np
import torch

from fedddl.compression.ternarize import PROBABILITY_BITS

__all__ = [
    "grace_terngrad_compress",
    "grace_terngrad_decompress",
    "naive_pack",
    "naive_ternarize",
    "python_pack",
    "python_unpack",
    "reference_codes",
]

_CODE_OF_SIGN = {0: 0b00, 1: 0b01, -1: 0b10}
_SIGN_OF_CODE = {0b00: 0, 0b01: 1, 0b10: -1}


def naive_ternarize(
    tensor: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, float]:
    """TernGrad without clipping via ``torch.rand``: returns ``(signs in {-1,0,1}, s)``."""
    scale = float(tensor.abs().max())
    if scale == 0.0:
        return torch.zeros_like(tensor, dtype=torch.int8), 0.0
    keep = torch.rand(tensor.shape, generator=generator) < tensor.abs() / scale
    return (torch.sign(tensor) * keep).to(torch.int8), scale


def naive_pack(signs: torch.Tensor) -> torch.Tensor:
    """Pack signs ``{-1, 0, 1}`` into 2-bit codes, 4 per byte, the straightforward way."""
    codes = torch.where(signs < 0, 2, signs.to(torch.int64)).reshape(-1).to(torch.uint8)
    codes = torch.cat([codes, codes.new_zeros((-codes.numel()) % 4)]).view(-1, 4)
    return codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)


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


def grace_terngrad_compress(
    tensor: torch.Tensor,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Size]:
    """TernGrad compression step by step as GRACE does it: clip to 2.5 population
    standard deviations, scalar ``s = max|clipped|``, a ``uniform_(0, s)`` sample per
    value, zero where the sample is ``>= |clipped|``, and the signs as ``int8``.

    Returns ``((int8 signs, 1-element scalar tensor), original shape)``.
    """
    shape = tensor.size()
    flat = tensor.flatten()
    deviation = torch.sqrt(torch.mean((flat - torch.mean(flat)) ** 2))
    bound = 2.5 * deviation.item()
    clipped = torch.clamp(flat, -bound, bound)
    magnitude = clipped.abs()
    scalar = magnitude.max()
    scaled_signs = clipped.sign() * scalar
    sample = torch.empty_like(flat).uniform_(0, scalar.item())
    scaled_signs[sample >= magnitude] = 0
    return (scaled_signs.sign().type(torch.int8), scalar.flatten()), shape


def grace_terngrad_decompress(
    compressed: tuple[torch.Tensor, torch.Tensor], shape: torch.Size
) -> torch.Tensor:
    """GRACE's TernGrad decompression: the ``int8`` signs as float32 times the scalar
    (a new tensor)."""
    signs, scalar = compressed
    return (signs.type(torch.float32) * scalar).view(shape)
