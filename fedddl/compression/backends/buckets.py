"""Scale buckets: one ternary scale per run of ``bucket`` consecutive values of a tensor.

A tensor of ``numel`` values in buckets of ``bucket`` has ``ceil(numel / bucket)`` scales;
bucket ``b`` holds values ``b * bucket`` up to ``(b + 1) * bucket`` (the last one may be
shorter) and its scale is the largest magnitude there (after clipping). Values are
ternarised as ``g / s_b`` against a scale of 1, so the TernGrad rule and its random stream
(:mod:`.ternarize`) are those of a plain tensor; a value decodes to ``s_b × code`` in
float32. Every operation here is elementwise or a per-bucket maximum, so the results do
not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
import torch

from fedddl.compression.backends.unpacking import unpack_codes

__all__ = [
    "bucket_count",
    "bucket_scales",
    "expand_scales",
    "normalized",
    "unpack_bucketed",
]


def bucket_count(numel: int, bucket: int) -> int:
    """Scales of a tensor of ``numel`` values in buckets of ``bucket`` (> 0)."""
    return -(-numel // bucket)


def bucket_scales(flat: torch.Tensor, bucket: int, clip_bound: float | None) -> torch.Tensor:
    """Per bucket ``max |g|`` of the float32 ``flat`` (each ``|g|`` clipped to
    ``clip_bound`` first when given): a float32 tensor of :func:`bucket_count` values."""
    magnitudes = flat.abs()
    if clip_bound is not None:
        magnitudes.clamp_(max=float(np.float32(clip_bound)))
    count = bucket_count(flat.numel(), bucket)
    padded = torch.zeros(count * bucket, dtype=torch.float32)
    padded[: flat.numel()] = magnitudes
    return padded.reshape(count, bucket).amax(dim=1)


def expand_scales(scales: torch.Tensor, bucket: int, numel: int) -> torch.Tensor:
    """Every value's bucket scale: ``scales`` repeated ``bucket`` times, cut to ``numel``."""
    return scales.repeat_interleave(bucket)[:numel]


def normalized(
    flat: torch.Tensor, scales: torch.Tensor, bucket: int, clip_bound: float | None
) -> torch.Tensor:
    """``clip(g) / s_b`` (values of an all-zero bucket stay 0): every magnitude at most 1,
    to be ternarised against a scale of 1."""
    if clip_bound is None:
        clipped = flat
    else:
        bound = float(np.float32(clip_bound))
        clipped = flat.clamp(-bound, bound)
    divisor = expand_scales(scales, bucket, flat.numel())
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    return (clipped / divisor).contiguous()


def unpack_bucketed(
    packed: torch.Tensor, numel: int, scales: torch.Tensor, bucket: int, codec: str
) -> torch.Tensor:
    """Decode packed codes with per-bucket ``scales``: ``s_b × code`` in float32 (new,
    flat). The codes must be valid (:func:`.packing.invalid_codes`)."""
    values = unpack_codes(packed, numel, 1.0, codec)
    values.mul_(expand_scales(scales, bucket, numel))
    return values
