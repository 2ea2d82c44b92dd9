"""The baselines of ``fedddl bench compression``: TernGrad written the plain way and as
GRACE implements it (Xu et al., ICDCS 2021; its PyTorch ``TernGradCompressor``: the same
sequence of tensor operations)."""

from __future__ import annotations

import torch

__all__ = [
    "grace_terngrad_compress",
    "grace_terngrad_decompress",
    "naive_pack",
    "naive_ternarize",
]


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
