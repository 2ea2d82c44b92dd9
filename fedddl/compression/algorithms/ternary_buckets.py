"""Which scale buckets a ternary compressor uses for a tensor (the ``scale-bucket`` setting).

``scale_bucket`` is 0 (one scale per tensor, TernGrad as published), ``N > 0`` (one scale per
bucket of ``N`` consecutive values, QSGD's buckets) or :data:`PER_CHANNEL` (one scale per
output channel: per slice ``tensor[i]`` of a tensor of two or more dimensions). A tensor that
would have a single bucket keeps one scale for the tensor (a plain entry, no bucket data).
"""

from __future__ import annotations

import math

import torch

from fedddl.compression.backends.buckets import bucket_scales, normalized

__all__ = ["PER_CHANNEL", "bucket_of", "check_scale_bucket", "prepare_buckets"]

#: ``scale_bucket`` value for one scale per output channel (dimension 0).
PER_CHANNEL = -1


def check_scale_bucket(scale_bucket: object) -> int:
    """Return ``scale_bucket`` if it is an int >= -1 (:data:`PER_CHANNEL`), else raise
    ``ValueError``."""
    if not isinstance(scale_bucket, int) or isinstance(scale_bucket, bool) or scale_bucket < -1:
        raise ValueError(
            f"scale_bucket must be 0 (per tensor), N > 0 (buckets of N values) or "
            f"{PER_CHANNEL} (per output channel), got {scale_bucket!r}"
        )
    return scale_bucket


def bucket_of(shape: tuple[int, ...], scale_bucket: int) -> int:
    """The bucket size a tensor of ``shape`` is sent with (0: one scale for the tensor)."""
    numel = math.prod(shape)
    if scale_bucket == PER_CHANNEL:
        if len(shape) < 2 or shape[0] < 2 or numel == 0:
            return 0
        return numel // shape[0]
    if scale_bucket > 0 and numel > scale_bucket:
        return scale_bucket
    return 0


def prepare_buckets(
    flat: torch.Tensor, bucket: int, clip_bound: float | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(values to ternarise against a scale of 1, bucket scales, their maximum)`` of the
    float32 ``flat`` in buckets of ``bucket`` values (clipped to ``clip_bound`` first)."""
    scales = bucket_scales(flat, bucket, clip_bound)
    return normalized(flat, scales, bucket, clip_bound), scales, float(scales.max())
