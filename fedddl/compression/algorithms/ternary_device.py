"""The ternary compressor on the torch path: a batch is validated, reduced on its devices,
ternarised and packed there, and crosses to the host in two copies per device (the
statistics, then one buffer of every tensor's bytes); payloads are views of that buffer.
Same contract and errors as the CPU path of
:meth:`~fedddl.compression.TernaryCompressor.compress_batch`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fedddl.compression.algorithms.payload import (
    Context,
    DensePayload,
    Payload,
    TernaryPayload,
    check_float_tensor,
)
from fedddl.compression.backends import device_kernels, device_path
from fedddl.compression.backends.device_path import DeviceGenerators
from fedddl.compression.backends.packing import packed_size
from fedddl.compression.backends.statistics import TensorStatistics

__all__ = ["TernaryRule", "compress_batch"]

_ALIGN = 8  # byte alignment of each tensor's slot in a transfer buffer (any dtype's itemsize)


class TernaryRule(Protocol):
    """What the torch path reads from a :class:`~fedddl.compression.TernaryCompressor`."""

    clip_sigma: float | None
    min_numel: int
    codec: str
    deterministic: bool
    threshold: float
    _generators: DeviceGenerators

    def _bounds(self, stats: TensorStatistics) -> tuple[float, float | None]: ...

    def _used_scale(self, local: float, scale: float | None) -> float: ...


@dataclass
class _Queued:
    """A tensor of the batch that needs a transfer slot: ternarised (``flat``) or dense."""

    index: int
    ctx: Context
    flat: torch.Tensor | None = None  # float32 values to ternarise
    dense: torch.Tensor | None = None  # values sent uncompressed
    scale: float = 0.0  # the float32 scaler used
    bound: float | None = None  # clip bound
    offset: int = 0  # byte offset in the device's transfer buffer
    nbytes: int = 0


def compress_batch(
    compressor: TernaryRule,
    tensors: Sequence[torch.Tensor],
    scales: Sequence[float | None] | None,
    label_errors: bool,
) -> list[tuple[Payload, Context]]:
    """``compressor.compress_batch`` on the torch path (same contract and errors).

    Validates every tensor and scale before the first random draw, so on any error the
    compressor's generators have not moved.
    """
    scales = [None] * len(tensors) if scales is None else list(scales)
    if len(scales) != len(tensors):
        raise ValueError(f"{len(scales)} scales for {len(tensors)} tensors")

    def label(index: int, error: Exception) -> Exception:
        return type(error)(f"tensor {index}: {error}") if label_errors else error

    results: list[tuple[Payload, Context] | None] = [None] * len(tensors)
    queued: list[_Queued] = []
    for index, (tensor, scale) in enumerate(zip(tensors, scales, strict=True)):
        try:
            item = _prepare(compressor, index, tensor, scale)
        except (ValueError, TypeError) as error:
            raise label(index, error) from error
        if isinstance(item, _Queued):
            queued.append(item)
        else:
            results[index] = item
    with_std = compressor.clip_sigma is not None
    checks = [  # statistics of ternarised tensors, finiteness of dense ones
        device_kernels.statistics(item.flat, with_std)
        if item.flat is not None
        else torch.isfinite(_dense(item)).all().to(torch.float64).reshape(1)
        for item in queued
    ]
    for item, values in zip(queued, device_path.gather_to_host(checks), strict=True):
        try:
            _choose_scale(compressor, item, values.tolist(), scales[item.index])
        except ValueError as error:
            raise label(item.index, error) from error
    # nothing can fail from here on: only now do the generators move
    host = _transfer(queued, lambda item, target: _fill(compressor, item, target))
    for item, data in zip(queued, host, strict=True):
        if item.flat is not None:
            payload: Payload = TernaryPayload(data, item.scale, item.ctx.numel, compressor.codec)
        else:
            payload = DensePayload(data.view(item.ctx.dtype).reshape(item.ctx.shape))
        results[item.index] = (payload, item.ctx)
    return [result for result in results if result is not None]


def _dense(item: _Queued) -> torch.Tensor:
    assert item.dense is not None
    return item.dense


def _prepare(
    compressor: TernaryRule, index: int, tensor: torch.Tensor, scale: float | None
) -> tuple[Payload, Context] | _Queued:
    """The result of a tensor that needs nothing from the device, else its queue entry."""
    check_float_tensor(tensor)
    ctx = Context(tuple(tensor.shape), tensor.dtype, tensor.device)
    detached = tensor.detach()
    if tensor.numel() < compressor.min_numel:
        if scale is not None:
            raise ValueError(
                f"tensor has {tensor.numel()} < min_numel={compressor.min_numel} elements and "
                "is sent uncompressed; do not pass scale="
            )
        return _Queued(index, ctx, dense=detached.reshape(-1))
    if tensor.numel() == 0:
        empty = torch.empty(0, dtype=torch.uint8)
        return TernaryPayload(empty, 0.0, 0, compressor.codec), ctx
    flat = detached.reshape(-1).to(dtype=torch.float32).contiguous()
    return _Queued(index, ctx, flat=flat)


def _choose_scale(
    compressor: TernaryRule, item: _Queued, values: list[float], shared: float | None
) -> None:
    """Check what came back from the device and set the item's scale, bound and size."""
    if item.flat is None:
        if values[0] != 1.0:
            raise ValueError("tensor has NaN or Inf values")
        item.nbytes = _dense(item).numel() * _dense(item).element_size()
        return
    peak, std = values
    if not math.isfinite(peak):
        raise ValueError(device_path.NON_FINITE)
    peak, bound = compressor._bounds(TensorStatistics(peak, std))
    item.scale = compressor._used_scale(peak if bound is None else bound, shared)
    item.bound = bound
    item.nbytes = packed_size(item.ctx.numel, compressor.codec)


def _fill(compressor: TernaryRule, item: _Queued, target: torch.Tensor) -> None:
    """Write the item's bytes (packed codes or raw values) into its slot ``target``."""
    if item.flat is None:
        target.copy_(_dense(item).contiguous().view(torch.uint8))
    elif item.scale == 0.0:  # all-zero tensor: the slot is already zero
        pass
    elif compressor.deterministic:
        device_kernels.ternarize_deterministic(
            item.flat, item.scale, item.bound, compressor.threshold, compressor.codec, target
        )
    else:
        generator = compressor._generators.get(item.flat.device)
        device_kernels.ternarize_stochastic(
            item.flat, item.scale, item.bound, generator, compressor.codec, target
        )


def _transfer(
    queued: Sequence[_Queued], fill: Callable[[_Queued, torch.Tensor], None]
) -> list[torch.Tensor]:
    """Fill one zeroed byte buffer per device (each item in an 8-byte aligned slot, in
    order), copy each buffer to the host once, and return the items' host slices."""
    buffers: dict[torch.device, int] = {}
    for item in queued:
        device = _device_of(item)
        item.offset = buffers.get(device, 0)
        buffers[device] = item.offset + -(-item.nbytes // _ALIGN) * _ALIGN
    on_device = {
        device: torch.zeros(size, dtype=torch.uint8, device=device)
        for device, size in buffers.items()
    }
    for item in queued:
        fill(item, on_device[_device_of(item)][item.offset : item.offset + item.nbytes])
    on_host = {device: device_path.to_host(buffer) for device, buffer in on_device.items()}
    return [on_host[_device_of(item)][item.offset : item.offset + item.nbytes] for item in queued]


def _device_of(item: _Queued) -> torch.device:
    return item.flat.device if item.flat is not None else _dense(item).device
