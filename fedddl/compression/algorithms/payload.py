"""What a compressor produces: a payload (the data to send) and its context.

Only two payload kinds exist, because the wire format
(:mod:`fedddl.compression.codecs.wire`) must be able to serialise every payload:

* :class:`DensePayload`: the tensor's values, uncompressed, in their own dtype.
* :class:`TernaryPayload`: packed ternary codes plus one float32 scale ``s``;
  element ``i`` decodes to ``s * c_i`` with ``c_i`` in ``{-1, 0, +1}`` (or, with scale
  buckets, to ``s_b * c_i`` with ``s_b`` the scale of its bucket and ``s = max s_b``;
  with the codec ``"base5"``, ``c_i`` in ``{-2, -1, 0, +1, +2}``, one scale).

A user-defined :class:`~fedddl.compression.Compressor` must return one of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedddl.compression.backends.base5 import MAX_BASE5_SCALE
from fedddl.compression.backends.buckets import bucket_count, unpack_bucketed
from fedddl.compression.backends.device_kernels import unpack_codes as unpack_on_device
from fedddl.compression.backends.packing import PAYLOAD_CODECS
from fedddl.compression.backends.unpacking import unpack_codes

__all__ = [
    "SUPPORTED_DTYPES",
    "Context",
    "DensePayload",
    "Payload",
    "TernaryPayload",
    "check_float_tensor",
    "decompress_payload",
]

#: Floating dtypes a compressor accepts and the wire format can carry.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
)

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Context:
    """What the receiver needs besides the payload: the original shape and dtype.

    ``device`` is where the sender's tensor lives; it is not sent, and only tells
    :func:`decompress_payload` where to rebuild the sender's view (error feedback) when
    it is not the CPU (the default: payloads are rebuilt where they are).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device = _CPU

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class DensePayload:
    """Uncompressed values (contiguous, original dtype, original shape)."""

    values: torch.Tensor


@dataclass(frozen=True)
class TernaryPayload:
    """Packed ternary codes and their scale.

    Attributes
    ----------
    codes:
        1-D ``uint8`` tensor of packed codes (layout: :mod:`fedddl.compression.backends.packing`).
    scale:
        The scaler ``s >= 0``; must be exactly representable as float32.
    numel:
        Number of packed values.
    codec:
        ``"2bit"`` (4 codes per byte), ``"base3"`` (5 codes per byte) or ``"base5"`` (five
        levels, 3 codes per 7 bits: :mod:`fedddl.compression.backends.base5`).
    bucket:
        0: one scale for the tensor. ``N > 0``: one scale per bucket of ``N`` consecutive
        values (:mod:`fedddl.compression.backends.buckets`), in ``bucket_scales``, and
        ``scale`` is their maximum.
    bucket_scales:
        With ``bucket > 0``: the float32 scales of the ``ceil(numel / N)`` buckets.
    """

    codes: torch.Tensor
    scale: float
    numel: int
    codec: str
    bucket: int = 0
    bucket_scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.codec not in PAYLOAD_CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; expected one of {PAYLOAD_CODECS}")
        if not math.isfinite(self.scale) or self.scale < 0:
            raise ValueError(f"scale must be finite and >= 0, got {self.scale}")
        if float(np.float32(self.scale)) != self.scale:
            raise ValueError(
                f"scale {self.scale!r} is not exactly a float32 (the wire stores float32)"
            )
        if self.codec == "base5" and self.scale > MAX_BASE5_SCALE:
            raise ValueError(f"scale {self.scale:.4g} would decode level 2 past float32")
        if self.bucket or self.bucket_scales is not None:
            self._check_buckets()

    def _check_buckets(self) -> None:
        scales = self.bucket_scales
        if self.codec == "base5":
            raise ValueError("codec 'base5' has one scale per tensor, not scale buckets")
        if not isinstance(self.bucket, int) or self.bucket < 1 or scales is None:
            raise ValueError(f"bucket must be an int >= 1 with bucket_scales, got {self.bucket!r}")
        count = bucket_count(self.numel, self.bucket)
        if scales.dtype != torch.float32 or tuple(scales.shape) != (count,):
            raise ValueError(
                f"bucket_scales must be {count} float32 values, got "
                f"{tuple(scales.shape)} {scales.dtype}"
            )
        if count and not (bool(torch.isfinite(scales).all()) and float(scales.min()) >= 0):
            raise ValueError("bucket scales must be finite and >= 0")
        largest = float(scales.max()) if count else 0.0
        if largest != self.scale:
            raise ValueError(f"scale {self.scale} is not the largest bucket scale")


Payload = DensePayload | TernaryPayload


def check_float_tensor(tensor: object) -> torch.Tensor:
    """Return ``tensor`` if it is a torch tensor of a supported floating dtype.

    Raises
    ------
    TypeError
        If it is not a tensor or its dtype is not in :data:`SUPPORTED_DTYPES`.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"unsupported dtype {tensor.dtype}; expected one of "
            f"{[str(d) for d in SUPPORTED_DTYPES]}"
        )
    return tensor


def decompress_payload(payload: Payload, ctx: Context) -> torch.Tensor:
    """Rebuild the tensor described by ``payload`` and ``ctx``.

    Shared by every compressor's ``decompress`` and by ``decode_update``, so the
    sender's view of what it sent (used for error feedback) is bit-identical to
    what the receiver decodes.  When ``ctx.device`` is not the CPU the result is
    rebuilt there (ternary codes are unpacked on it).
    """
    if isinstance(payload, DensePayload):
        values = payload.values
        if tuple(values.shape) != ctx.shape or values.dtype != ctx.dtype:
            raise ValueError(
                f"dense payload is {tuple(values.shape)}/{values.dtype}, "
                f"context says {ctx.shape}/{ctx.dtype}"
            )
        if ctx.device.type != "cpu":  # e.g. the torch path's host copy of a device tensor
            return values.to(ctx.device, copy=True)
        return values.clone()
    if isinstance(payload, TernaryPayload):
        if payload.numel != ctx.numel:
            raise ValueError(f"payload has {payload.numel} values, context needs {ctx.numel}")
        if payload.bucket:
            assert payload.bucket_scales is not None
            flat = unpack_bucketed(
                payload.codes.cpu(), payload.numel, payload.bucket_scales.cpu(), payload.bucket,
                payload.codec,
            )
            return flat.to(ctx.dtype).reshape(ctx.shape).to(ctx.device)
        if ctx.device.type != "cpu" and payload.codec != "base5":  # unpack where it lives
            out = torch.empty(payload.numel, dtype=ctx.dtype, device=ctx.device)
            codes = payload.codes.to(ctx.device)
            unpack_on_device(codes, payload.numel, payload.scale, payload.codec, out)
            return out.reshape(ctx.shape)
        flat = unpack_codes(payload.codes.cpu(), payload.numel, payload.scale, payload.codec)
        return flat.to(ctx.dtype).reshape(ctx.shape).to(ctx.device)
    raise TypeError(f"unknown payload type {type(payload).__name__}")
