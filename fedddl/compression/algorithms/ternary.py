"""TernGrad (Wen et al., 2017): layer-wise scaler, clipping, stochastic ternarisation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fedddl.compression.algorithms import ternary_device
from fedddl.compression.algorithms.base import Compressor
from fedddl.compression.algorithms.payload import (
    Context,
    DensePayload,
    Payload,
    TernaryPayload,
    check_float_tensor,
)
from fedddl.compression.algorithms.ternary_buckets import (
    bucket_of,
    check_scale_bucket,
    prepare_buckets,
)
from fedddl.compression.backends import device_path
from fedddl.compression.backends.packing import CODECS, packed_size
from fedddl.compression.backends.statistics import (
    TensorStatistics,
    tensor_statistics,
    tensor_statistics_batch,
)
from fedddl.compression.backends.ternarize import (
    RandomBits,
    ternarize_deterministic,
    ternarize_stochastic_batch,
)

__all__ = ["TernaryCompressor", "TernaryEntropyCompressor"]


def _as_float32_scale(value: float) -> float:
    return float(np.float32(value))


class TernaryCompressor(Compressor):
    """Ternary gradients ``s * sign(g) * b`` sent at 2 (or 1.6) bits per value.

    Per tensor: optional clipping of ``g`` to ``[-c*sigma, c*sigma]``
    (``sigma`` = population std of the tensor), scaler ``s = max|g_clipped|``,
    then ``b ~ Bernoulli(|g_clipped| / s)`` so ``E[g~] = g_clipped`` (up to the
    ``2**-16`` probability resolution, see :mod:`fedddl.compression.backends.ternarize`).

    Parameters
    ----------
    clip_sigma:
        ``c`` (TernGrad's default 2.5); ``None`` disables clipping. A constant
        tensor (``sigma = 0``) is never clipped.
    seed:
        Seed of the random stream: the same seed and the same sequence of
        calls give the same codes.
    deterministic:
        If true, no randomness: ``sign(g) * s`` where ``|g_clipped| > threshold * s``,
        else 0 (biased).
    threshold:
        Cut of the deterministic mode, in ``[0, 1]``.
    min_numel:
        Tensors with fewer elements are sent uncompressed in their own dtype
        (e.g. biases).
    codec:
        ``"2bit"`` (4 codes per byte) or ``"base3"`` (5 codes per byte).
    scale_bucket:
        0: one scaler per tensor. ``N > 0``: one per bucket of ``N`` consecutive values;
        ``-1``: one per output channel (:mod:`fedddl.compression.algorithms.ternary_buckets`).
        Each bucket's scaler is its ``max|g_clipped|`` (clipping stays per tensor) and its
        values fire with probability ``|g_clipped| / s_b``. Shared scales (``scale=``) need 0;
        tensors off the CPU are ternarised on the host.

    Notes
    -----
    An instance owns one random stream: do not call :meth:`compress` on the
    same instance from several threads at once (use one instance per worker).
    Tensors off the CPU are ternarised and packed on their device with torch ops
    (:mod:`fedddl.compression.algorithms.ternary_device`; its own seeded generator per device,
    so stochastic codes differ from the CPU path's for the same seed); only the
    packed bytes and the statistics are copied to the host.
    """

    name = "ternary"
    ternary = True

    def __init__(
        self,
        clip_sigma: float | None = 2.5,
        seed: int = 0,
        deterministic: bool = False,
        threshold: float = 0.5,
        min_numel: int = 0,
        codec: str = "2bit",
        scale_bucket: int = 0,
    ) -> None:
        if clip_sigma is not None and not (math.isfinite(clip_sigma) and clip_sigma > 0):
            raise ValueError(f"clip_sigma must be positive and finite, or None; got {clip_sigma}")
        if not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
            raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
        if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int, got {min_numel!r}")
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
        self.clip_sigma = clip_sigma
        self.seed = seed
        self.deterministic = bool(deterministic)
        self.threshold = float(threshold)
        self.min_numel = min_numel
        self.codec = codec
        self.scale_bucket = check_scale_bucket(scale_bucket)
        self._bits = RandomBits(seed)
        self._generators = device_path.DeviceGenerators(seed)  # the torch path's
        if codec == "base3":
            self.name = "ternary-base3"

    def __repr__(self) -> str:
        return (
            f"TernaryCompressor(clip_sigma={self.clip_sigma}, seed={self.seed}, "
            f"deterministic={self.deterministic}, threshold={self.threshold}, "
            f"min_numel={self.min_numel}, codec={self.codec!r}"
            + (f", scale_bucket={self.scale_bucket})" if self.scale_bucket else ")")
        )

    def _bounds(self, stats: TensorStatistics) -> tuple[float, float | None]:
        """``(max|g|, clip bound or None)`` of a tensor with these statistics."""
        if self.clip_sigma is None or stats.peak == 0.0:
            return stats.peak, None
        bound = self.clip_sigma * stats.std
        if bound == 0.0 or bound >= stats.peak:
            return stats.peak, None
        return stats.peak, bound

    def _statistics(self, flat: torch.Tensor) -> tuple[float, float | None]:
        """Return ``(max|g|, clip bound or None)``; raise on non-finite values."""
        return self._bounds(tensor_statistics(flat, with_std=self.clip_sigma is not None))

    def local_scale(self, tensor: torch.Tensor) -> float | None:
        """The scaler ``s = max|g_clipped|`` (float32) for ``tensor``; ``None`` if it
        would be sent uncompressed (fewer than ``min_numel`` elements)."""
        check_float_tensor(tensor)
        if tensor.numel() < self.min_numel:
            return None
        if tensor.numel() == 0:
            return 0.0
        if device_path.uses_torch_path([tensor]):  # reduced on the device
            with_std = self.clip_sigma is not None
            peak, bound = self._bounds(device_path.tensor_statistics(tensor, with_std))
            return _as_float32_scale(peak if bound is None else bound)
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
        peak, bound = self._statistics(flat)
        return _as_float32_scale(peak if bound is None else bound)

    def compress(
        self, tensor: torch.Tensor, *, scale: float | None = None
    ) -> tuple[Payload, Context]:
        """Ternarise a finite floating ``tensor`` (any shape, fp16/bf16/fp32/fp64).

        ``scale``, a shared scaler, must be ``>=`` :meth:`local_scale` of this tensor (e.g. the
        max over workers), so ``b ~ Bernoulli(|g_clipped| / scale)`` stays unbiased. Raises
        ``ValueError`` on non-finite values, or a non-finite ``scale`` or one below the local
        scale.
        """
        return self._compress_many([tensor], [scale], label_errors=False)[0]

    def compress_batch(
        self, tensors: Sequence[torch.Tensor], scales: Sequence[float | None] | None = None
    ) -> list[tuple[Payload, Context]]:
        """:meth:`compress` of several tensors, bit-identical to calling it on each
        in order, but with the work of all of them shared out over the threads.

        Errors name the tensor by its index (``"tensor 3: ..."``); on any error
        the random stream has not moved.  A batch with any tensor off the CPU
        goes to the torch path as a whole (so it equals one-at-a-time calls when
        all its tensors are on the CPU or all are off it).
        """
        return self._compress_many(tensors, scales, label_errors=True)

    def _compress_many(
        self,
        tensors: Sequence[torch.Tensor],
        scales: Sequence[float | None] | None,
        label_errors: bool,
    ) -> list[tuple[Payload, Context]]:
        if not self.scale_bucket and device_path.uses_torch_path(tensors):  # torch ops there
            return ternary_device.compress_batch(self, tensors, scales, label_errors)
        scales = [None] * len(tensors) if scales is None else list(scales)
        if len(scales) != len(tensors):
            raise ValueError(f"{len(scales)} scales for {len(tensors)} tensors")

        def label(index: int, error: Exception) -> Exception:
            if not label_errors:
                return error
            return type(error)(f"tensor {index}: {error}")

        results: list[tuple[Payload, Context] | None] = [None] * len(tensors)
        pending: list[tuple[int, torch.Tensor, Context]] = []  # ternarised: index, flat, ctx
        for index, (tensor, scale) in enumerate(zip(tensors, scales, strict=True)):
            try:
                results[index] = self._prepare(tensor, scale, index, pending)
            except (ValueError, TypeError) as error:
                raise label(index, error) from error
        stats = tensor_statistics_batch(
            [flat for _, flat, _ in pending],
            with_std=self.clip_sigma is not None,
            labels=[f"tensor {index}" for index, _, _ in pending] if label_errors else None,
        )
        chosen = []  # (index, flat, ctx, used scale, clip bound)
        for (index, flat, ctx), tensor_stats in zip(pending, stats, strict=True):
            peak, bound = self._bounds(tensor_stats)
            try:
                used = self._used_scale(peak if bound is None else bound, scales[index])
                if scales[index] is not None and bucket_of(ctx.shape, self.scale_bucket):
                    raise ValueError("shared scales need one scale per tensor (scale_bucket=0)")
            except ValueError as error:
                raise label(index, error) from error
            chosen.append((index, flat, ctx, used, bound))
        # nothing can fail from here on: only now does the random stream move
        stochastic = []
        buckets: dict[int, tuple[int, torch.Tensor]] = {}  # index -> (bucket, its scales)
        for index, flat, ctx, used, bound in chosen:
            bucket = bucket_of(ctx.shape, self.scale_bucket)  # by shape alone (spec checks)
            if bucket:  # ternarised as values / bucket scale against a scale of 1
                flat, bucket_scales, used = prepare_buckets(flat, bucket, bound)
                buckets[index] = (bucket, bucket_scales)
                bound, unit = None, 1.0
            else:
                unit = used
            if used == 0.0:  # all-zero tensor
                packed = torch.zeros(packed_size(flat.numel(), self.codec), dtype=torch.uint8)
            elif self.deterministic:
                packed = ternarize_deterministic(flat, unit, bound, self.threshold, self.codec)
            else:
                stochastic.append((index, flat, ctx, used, unit, bound))
                continue
            results[index] = (self._payload(packed, used, flat.numel(), buckets.get(index)), ctx)
        codes = ternarize_stochastic_batch(
            [flat for _, flat, _, _, _, _ in stochastic],
            [unit for _, _, _, _, unit, _ in stochastic],
            [bound for _, _, _, _, _, bound in stochastic],
            self._bits,
            self.codec,
        )
        for (index, flat, ctx, used, _, _), packed in zip(stochastic, codes, strict=True):
            results[index] = (self._payload(packed, used, flat.numel(), buckets.get(index)), ctx)
        return [result for result in results if result is not None]

    def _payload(
        self,
        packed: torch.Tensor,
        scale: float,
        numel: int,
        buckets: tuple[int, torch.Tensor] | None,
    ) -> TernaryPayload:
        if buckets is None:
            return TernaryPayload(packed, scale, numel, self.codec)
        return TernaryPayload(packed, scale, numel, self.codec, *buckets)

    def _prepare(
        self,
        tensor: torch.Tensor,
        scale: float | None,
        index: int,
        pending: list[tuple[int, torch.Tensor, Context]],
    ) -> tuple[Payload, Context] | None:
        """The result for a tensor that needs no statistics, else queue it in ``pending``."""
        check_float_tensor(tensor)
        ctx = Context(tuple(tensor.shape), tensor.dtype, tensor.device)
        detached = tensor.detach()
        if tensor.numel() < self.min_numel:
            if scale is not None:
                raise ValueError(
                    f"tensor has {tensor.numel()} < min_numel={self.min_numel} elements and is "
                    "sent uncompressed; do not pass scale="
                )
            values = detached.contiguous().clone()
            if not bool(torch.isfinite(values).all()):
                raise ValueError("tensor has NaN or Inf values")
            return DensePayload(values), ctx
        flat = detached.reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
        if flat.numel() == 0:
            return TernaryPayload(torch.empty(0, dtype=torch.uint8), 0.0, 0, self.codec), ctx
        pending.append((index, flat, ctx))
        return None

    @staticmethod
    def _used_scale(local: float, scale: float | None) -> float:
        """The float32 scaler to use: the local one, or a valid shared one."""
        local = _as_float32_scale(local)
        if scale is None:
            return local
        if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
            raise ValueError(f"scale must be a finite number, got {scale!r}")
        used = _as_float32_scale(scale)
        if used < local:
            raise ValueError(f"shared scale {scale} is below this tensor's local scale {local}")
        return used


class TernaryEntropyCompressor(TernaryCompressor):
    """``ternary-base3`` codes, with each whole message entropy-coded by zstd.

    The codes (hence the decoded values) are exactly those of
    ``TernaryCompressor(codec="base3")`` with the same arguments; only the
    message is smaller: :func:`~fedddl.compression.encode_update` compresses
    the message's body (:mod:`fedddl.compression.codecs.entropy`) and sends the plain
    base-3 message instead whenever that would not be smaller.
    """

    name = "ternary-entropy"
    entropy_coding = "zstd"

    def __init__(
        self,
        clip_sigma: float | None = 2.5,
        seed: int = 0,
        deterministic: bool = False,
        threshold: float = 0.5,
        min_numel: int = 0,
        scale_bucket: int = 0,
    ) -> None:
        if scale_bucket:  # the FDTE body carries no format version for bucket entries
            raise ValueError("ternary-entropy sends one scale per tensor; use scale_bucket=0")
        super().__init__(clip_sigma, seed, deterministic, threshold, min_numel, codec="base3")
        self.name = "ternary-entropy"

    def __repr__(self) -> str:
        return super().__repr__().replace("TernaryCompressor(", "TernaryEntropyCompressor(", 1)
