"""The torch back end: tensors off the CPU are reduced, ternarised, packed and unpacked
where they live (kernels: :mod:`fedddl.compression.backends.device_kernels`).

Every copy between host and device goes through :func:`to_host` / :func:`to_device`.
Stochastic codes draw from one seeded :class:`torch.Generator` per device
(:class:`DeviceGenerators`), not from the CPU path's stream: for the same seed the two
paths give different, equally distributed codes; everything else is bit-identical.
:func:`torch_path_on_cpu` sends CPU tensors through this path too (tests, benchmarks).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch

from fedddl.compression.backends import device_kernels as kernels
from fedddl.compression.backends.statistics import TensorStatistics

__all__ = [
    "NON_FINITE",
    "DeviceGenerators",
    "gather_to_host",
    "pieces",
    "tensor_statistics",
    "to_device",
    "to_host",
    "torch_path_on_cpu",
    "unpack_into",
    "unpacks_on_device",
    "uses_torch_path",
]

_FORCED: ContextVar[bool] = ContextVar("fedddl_torch_path_on_cpu", default=False)
NON_FINITE = "tensor has NaN or Inf values (or values beyond float32 range)"
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
    """Whether the ternary compressor compresses ``tensors`` on the torch path: any of
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
        raise ValueError(NON_FINITE)
    return TensorStatistics(peak, std)


def gather_to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy small same-dtype 1-D tensors to the host with one copy per device."""
    groups: dict[torch.device, list[int]] = {}
    for position, tensor in enumerate(tensors):
        groups.setdefault(tensor.device, []).append(position)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for positions in groups.values():
        parts = [tensors[p] for p in positions]
        host = to_host(torch.cat(parts))
        for position, piece in zip(positions, pieces(host, parts), strict=True):
            out[position] = piece
    return [piece for piece in out if piece is not None]


def pieces(joined: torch.Tensor, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
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
            for position, codes in zip(positions, pieces(staged, packed), strict=True):
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
