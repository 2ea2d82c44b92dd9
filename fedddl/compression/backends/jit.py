"""Optional compiled kernels (numba), with the numpy code as the fallback.

The hot loops (stochastic ternarisation fused with packing, table decoding) have a numba
version in :mod:`fedddl.compression.backends.kernels` and a numpy version beside each
caller; both give bit-identical results, so whether numba is used never changes a message.
numba is imported, and the kernels compiled, only when a call first reaches
:data:`MIN_NUMEL` values. ``FEDDDL_JIT=0`` or :func:`set_jit` turns them off; a process that
forks workers calls :func:`fedddl.compression.warmup.warm_up` first.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

__all__ = ["MIN_NUMEL", "available", "jit_kernels", "loaded_kernels", "mode", "set_jit"]

#: Calls on fewer values than this use the numpy code (no numba import, no compile).
MIN_NUMEL = 1 << 16

_lock = threading.Lock()
_mode: bool | None = None if os.environ.get("FEDDDL_JIT", "") != "0" else False
_kernels: ModuleType | None = None
_failed = False


def set_jit(mode: bool | None) -> None:
    """``True``: always use the kernels (any size; raises if numba is missing),
    ``False``: never, ``None``: the default (from :data:`MIN_NUMEL` values on, if
    numba is installed)."""
    global _mode
    if mode is True and not available():
        raise RuntimeError("numba is not installed: the compiled kernels are unavailable")
    _mode = mode


def available() -> bool:
    """Whether numba can be imported and the kernels compiled."""
    return _load() is not None


def _load() -> ModuleType | None:
    global _kernels, _failed
    if _kernels is not None or _failed:
        return _kernels
    with _lock:
        if _kernels is None and not _failed:
            try:
                from fedddl.compression.backends import kernels
            except ImportError:
                _failed = True
            else:
                _kernels = kernels
    return _kernels


def jit_kernels(numel: int) -> ModuleType | None:
    """The kernels module to use for a call on ``numel`` values, or ``None`` (numpy)."""
    if _mode is False or (_mode is None and numel < MIN_NUMEL):
        return None
    return _load()


def loaded_kernels() -> ModuleType | None:
    """The kernels module, loaded now, unless the kernels are turned off or unavailable."""
    return None if _mode is False else _load()


def mode() -> bool | None:
    """The :func:`set_jit` mode in force."""
    return _mode
