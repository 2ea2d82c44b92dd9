"""The data of an entry with scale buckets (kinds 3 and 4 of :mod:`.layout`): checked, then
decoded.

The data is ``ceil(numel / N)`` little-endian float32 bucket scales, then the packed codes.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from fedddl.compression.backends.buckets import unpack_bucketed
from fedddl.compression.backends.packing import invalid_codes
from fedddl.compression.codecs.errors import PayloadError
from fedddl.compression.codecs.wire.layout import bucket_scale_bytes

__all__ = ["check_bucket_data", "decode_bucket_data"]


def _split(source: np.ndarray[Any, Any], numel: int, bucket: int) -> tuple[Any, Any]:
    """``(bucket scales as float32, packed codes)`` of an entry's data bytes."""
    cut = bucket_scale_bytes(numel, bucket)
    return source[:cut].view("<f4"), source[cut:]


def check_bucket_data(
    name: str, source: np.ndarray[Any, Any], numel: int, scale: float, bucket: int, codec: str
) -> None:
    """Check a bucket entry's data: every bucket scale finite, >= 0, their maximum the
    header's ``scale``; every code valid.

    Raises
    ------
    PayloadError
        Naming the tensor and the problem.
    """
    scales, codes = _split(source, numel, bucket)
    if scales.size:
        if not bool(np.isfinite(scales).all()):
            raise PayloadError(f"tensor {name!r}: non-finite bucket scale")
        if float(scales.min()) < 0:
            raise PayloadError(f"tensor {name!r}: negative bucket scale")
        if float(scales.max()) != scale:
            raise PayloadError(
                f"tensor {name!r}: the largest bucket scale {float(scales.max())} is not the "
                f"header's scale {scale}"
            )
    problem = invalid_codes(codes, numel, codec)
    if problem is not None:
        raise PayloadError(f"tensor {name!r}: {problem}")


def decode_bucket_data(
    source: np.ndarray[Any, Any], numel: int, bucket: int, codec: str
) -> torch.Tensor:
    """The float32 values (new, flat) of a checked bucket entry's data."""
    scales, codes = _split(source, numel, bucket)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: copied out of
        packed = torch.from_numpy(codes)
        bucket_scales = torch.from_numpy(scales.astype(np.float32))
    return unpack_bucketed(packed, numel, bucket_scales, bucket, codec)
