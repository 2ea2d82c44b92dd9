"""A torch function mode that catches tensors of different devices meeting in one op.

Without a GPU, device-generic code runs on CPU tensors and cannot mix devices by
mistake; on the ``meta`` device it can, and most ops mixing a meta and a CPU tensor raise
on their own.  Not all do (``index_select`` of a CPU table with a meta index silently
reads garbage), and a transfer that should not happen (a CPU tensor created inside a
kernel, then moved) raises nothing.  :class:`DeviceGuard` checks every torch call made
inside it, before it runs:

* ``DeviceGuard(only="meta")``: every tensor and generator an op sees or returns is on
  that device (for kernels, which must neither create host tensors nor synchronise);
* ``DeviceGuard()``: no op sees tensors of two devices, except the transfers ``Tensor.to``
  and ``Tensor.copy_``, which are recorded in :attr:`DeviceGuard.transfers` as
  ``(op name, source device, destination device)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["DeviceGuard", "DeviceMixingError"]

_TRANSFERS = {"to", "copy_"}


class DeviceMixingError(AssertionError):
    """Tensors of different devices met in one op."""


def _devices(*trees: Any) -> list[torch.device]:
    found = []
    for leaf in tree_leaves(trees):
        if isinstance(leaf, (torch.Tensor, torch.Generator)):
            found.append(leaf.device)
    return found


class DeviceGuard(TorchFunctionMode):
    """Raise :class:`DeviceMixingError` when an op mixes devices (see the module docstring)."""

    def __init__(self, only: str | torch.device | None = None) -> None:
        super().__init__()
        self.only = None if only is None else torch.device(only)
        self.transfers: list[tuple[str, torch.device, torch.device]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        seen = set(_devices(args, kwargs))
        if self.only is not None:
            self._check_only(name, seen)
        result = func(*args, **kwargs)
        produced = set(_devices(result))
        if self.only is not None:
            self._check_only(name, produced)
            return result
        devices = seen | produced
        if len(devices) > 1:
            if name not in _TRANSFERS:
                raise DeviceMixingError(f"{name} mixes devices {sorted(map(str, devices))}")
            source = args[1] if name == "copy_" else args[0]
            target = args[0] if name == "copy_" else result
            self.transfers.append((name, source.device, target.device))
        return result

    def _check_only(self, name: str, devices: set[torch.device]) -> None:
        stray = {device for device in devices if device != self.only}
        if stray:
            raise DeviceMixingError(
                f"{name} touches {sorted(map(str, stray))} inside a {self.only} kernel"
            )
