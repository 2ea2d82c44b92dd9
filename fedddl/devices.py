"""Device names of a run: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.

A run's models, replicas, shards, momentum and residuals live on one device. Off the CPU,
compression runs there too and only packed bytes cross to the host.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["check_device_name", "resolve_device"]

_NAME = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def check_device_name(name: str) -> str:
    """Return ``name`` if it is a device name fedddl accepts, else raise ``ValueError``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}")
    return name


def resolve_device(name: str) -> torch.device:
    """The :class:`torch.device` for ``name`` (``auto``: CUDA when present, else the CPU).

    Raises
    ------
    ValueError
        If the name is malformed, or CUDA (or that CUDA device) is not available.
    """
    import torch

    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    device = torch.device(name)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {name!r} asked for, but there are {torch.cuda.device_count()} CUDA devices"
        )
    return device
