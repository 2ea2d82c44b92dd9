"""The torch path of :class:`~fedddl.compression.TernaryCompressor` and of ``decode_update``.

Tensors off the CPU are ternarised, packed and decoded where they live, with the kernels
of :mod:`fedddl.compression.device_kernels`; CPU tensors keep the threaded numpy path.
What crosses between host and device, per device and per call:

* :func:`compress_batch`: two device-to-host copies, however many tensors: the statistics
  (two float64 per tensor, plus one finiteness flag per tensor sent uncompressed), then
  one buffer holding every tensor's packed codes and every uncompressed tensor's bytes.
  The payloads are views of that host buffer.
* :func:`unpack_into` (``decode_update(data, out=device_tensors)``): one host-to-device
  copy of the packed bytes of every ternary entry; unpacking writes into ``out`` there.
* :func:`tensor_statistics` (``local_scale``): one copy of two float64.

Randomness
----------
The stochastic codes of the torch path draw their 16-bit integers from a
:class:`torch.Generator` on the tensor's device (one per device and compressor, seeded
from the compressor's seed), not from the CPU path's PCG64DXSM stream, so for the same
seed the two paths give different (equally distributed) codes.  The same seed and the
same sequence of calls give the same codes on the same kind of device with the same
PyTorch version (CUDA's generator advances by an amount that depends on the launch
configuration, so different GPU models may differ).  The deterministic mode, the scale
without clipping, and packing and unpacking are bit-identical on both paths; with
clipping, the float64 statistics here and the float32-chunk sums of the CPU path can put
the scale one or a few float32 steps apart.

:func:`torch_path_on_cpu` sends CPU tensors through this path too (tests, benchmarks).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedddl.compression import device_kernels as kernels
from fedddl.compression.packing import packed_size
from fedddl.compression.payload import (
    Context,
    DensePayload,
    Payload,
    TernaryPayload,
    check_float_tensor,
)
from fedddl.compression.statistics import TensorStatistics

if TYPE_CHECKING:
    from fedddl.compression.ternary import TernaryCompressor

__all__ = [
    "DeviceGenerators",
    "compress_batch",
    "tensor_statistics",
    "to_device",
    "to_host",
    "torch_path_on_cpu",
    "unpack_into",
    "unpacks_on_device",
    "uses_torch_path",
]

_FORCED: ContextVar[bool] = ContextVar("fedddl_torch_path_on_cpu", default=False)
_ALIGN = 8  # byte alignment of each tensor's slot in a transfer buffer (any dtype's itemsize)
_NON_FINITE = "tensor has NaN or Inf values (or values beyond float32 range)"
# mixes the compressor's seed into the device generator's, so that a model seeded with the
# same integer (torch.manual_seed(seed)) does not draw the same random numbers
_SEED_TAG = 0x7465726E67726164  # "terngrad"


@contextmanager
def torch_path_on_cpu(enabled: bool = True) -> Iterator[None]:
    """Within the block (in this thread or task), CPU tensors take the torch path too.

    For tests and benchmarks of the device-generic code on a machine without a GPU.
    """
    token = _FORCED.set(enabled)
    try:
        yield
    finally:
        _FORCED.reset(token)


def uses_torch_path(tensors: Sequence[object]) -> bool:
    """Whether :class:`TernaryCompressor` compresses ``tensors`` on the torch path: any of
    them is off the CPU (a mixed batch goes there as a whole), or the path is forced."""
    return _FORCED.get() or any(
        isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors
    )


def unpacks_on_device(target: torch.Tensor) -> bool:
    """Whether ``decode_update`` unpacks a ternary entry into ``target`` with torch ops."""
    return _FORCED.get() or target.device.type != "cpu"


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Copy ``tensor`` to the host: every device-to-host copy of this path goes through here."""
    return tensor.to("cpu")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy host ``tensor`` to ``device``: every host-to-device copy of this path goes here."""
    return tensor.to(device)


class DeviceGenerators:
    """One seeded :class:`torch.Generator` per device, created on first use."""

    def __init__(self, seed: int) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self._base = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @functools.cached_property
    def seed(self) -> int:
        """The torch seed of every device's generator, derived from the compressor's seed
        (when first needed: a compressor that never leaves the CPU does not pay for it)."""
        words = np.random.SeedSequence([self._base, _SEED_TAG]).generate_state(1, np.uint64)
        return int(words[0]) & ((1 << 63) - 1)

    def get(self, device: torch.device) -> torch.Generator | None:
        """The generator of ``device`` (seeded with :attr:`seed` when first asked for);
        ``None`` for ``meta``, which has none (its tensors hold no values)."""
        if device.type == "meta":
            return None
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def tensor_statistics(tensor: torch.Tensor, with_std: bool) -> TensorStatistics:
    """``max|g|`` and std of a non-empty floating tensor, reduced on its device.

    Raises
    ------
    ValueError
        If any value is NaN or infinite (or beyond float32 range).
    """
    flat = tensor.detach().reshape(-1).to(dtype=torch.float32).contiguous()
    peak, std = to_host(kernels.statistics(flat, with_std)).tolist()
    if not math.isfinite(peak):
        raise ValueError(_NON_FINITE)
    return TensorStatistics(peak, std)


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
    compressor: TernaryCompressor,
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
        kernels.statistics(item.flat, with_std)
        if item.flat is not None
        else torch.isfinite(_dense(item)).all().to(torch.float64).reshape(1)
        for item in queued
    ]
    for item, values in zip(queued, _gather_to_host(checks), strict=True):
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
    compressor: TernaryCompressor, index: int, tensor: torch.Tensor, scale: float | None
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
    compressor: TernaryCompressor, item: _Queued, values: list[float], shared: float | None
) -> None:
    """Check what came back from the device and set the item's scale, bound and size."""
    if item.flat is None:
        if values[0] != 1.0:
            raise ValueError("tensor has NaN or Inf values")
        item.nbytes = _dense(item).numel() * _dense(item).element_size()
        return
    peak, std = values
    if not math.isfinite(peak):
        raise ValueError(_NON_FINITE)
    peak, bound = compressor._bounds(TensorStatistics(peak, std))
    item.scale = compressor._used_scale(peak if bound is None else bound, shared)
    item.bound = bound
    item.nbytes = packed_size(item.ctx.numel, compressor.codec)


def _fill(compressor: TernaryCompressor, item: _Queued, target: torch.Tensor) -> None:
    """Write the item's bytes (packed codes or raw values) into its slot ``target``."""
    if item.flat is None:
        target.copy_(_dense(item).contiguous().view(torch.uint8))
    elif item.scale == 0.0:  # all-zero tensor: the slot is already zero
        pass
    elif compressor.deterministic:
        kernels.ternarize_deterministic(
            item.flat, item.scale, item.bound, compressor.threshold, compressor.codec, target
        )
    else:
        generator = compressor._generators.get(item.flat.device)
        kernels.ternarize_stochastic(
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
    on_host = {device: to_host(buffer) for device, buffer in on_device.items()}
    return [on_host[_device_of(item)][item.offset : item.offset + item.nbytes] for item in queued]


def _device_of(item: _Queued) -> torch.device:
    return item.flat.device if item.flat is not None else _dense(item).device


def _gather_to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy small same-dtype 1-D tensors to the host with one copy per device."""
    groups: dict[torch.device, list[int]] = {}
    for position, tensor in enumerate(tensors):
        groups.setdefault(tensor.device, []).append(position)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for positions in groups.values():
        parts = [tensors[p] for p in positions]
        host = to_host(torch.cat(parts))
        for position, piece in zip(positions, _pieces(host, parts), strict=True):
            out[position] = piece
    return [piece for piece in out if piece is not None]


def _pieces(joined: torch.Tensor, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``joined`` (the concatenation of ``parts``) with the parts' lengths."""
    ends = list(itertools.accumulate(part.numel() for part in parts))
    return [joined[end - part.numel() : end] for part, end in zip(parts, ends, strict=True)]


def unpack_into(items: Sequence[tuple[torch.Tensor, int, float, str, torch.Tensor]]) -> None:
    """Decode validated packed codes into their ``out`` tensors, on the tensors' devices.

    Each item is ``(packed host bytes, numel, scale, codec, out)`` with ``out`` a floating
    tensor of ``numel`` elements (any shape, dtype and layout).  The packed bytes of all
    items of one device cross to it in one copy; the codes must already be valid (as
    ``decode_update`` checks), so nothing here can fail on the message's account.
    """
    groups: dict[torch.device, list[int]] = {}
    for position, (*_, out) in enumerate(items):
        groups.setdefault(out.device, []).append(position)
    with torch.no_grad():
        for device, positions in groups.items():
            packed = [items[p][0].reshape(-1) for p in positions]
            staged = to_device(torch.cat(packed), device)
            for position, codes in zip(positions, _pieces(staged, packed), strict=True):
                _, numel, scale, codec, out = items[position]
                _unpack_one(codes, numel, scale, codec, out.detach())


def _unpack_one(
    codes: torch.Tensor, numel: int, scale: float, codec: str, out: torch.Tensor
) -> None:
    if out.is_contiguous():
        kernels.unpack_codes(codes, numel, scale, codec, out.view(-1))
        return
    flat = torch.empty(numel, dtype=out.dtype, device=out.device)
    kernels.unpack_codes(codes, numel, scale, codec, flat)
    out.copy_(flat.view(out.shape))
