"""Optional compiled kernels (numba), with the numpy code as the fallback.

The hot loops of this package (stochastic ternarisation fused with packing,
table decoding) have a numba version in :mod:`fedddl.compression.kernels`
and a numpy version beside each caller.  Both give bit-identical results
(tested), so whether numba is installed, or used, never changes a message.

numba is imported, and the kernels compiled (or loaded from numba's cache),
only the first time a call is large enough to need them
(:data:`MIN_NUMEL` values): small models never pay for it.

Set the environment variable ``FEDDDL_JIT=0`` to never use the kernels, or
call :func:`set_jit`.

Loading the kernels (numba's import and its cache) costs about 0.8 s in a fresh process.
A process that forks workers (the warm ClientApp server of a deployment, which forks one
process per message) should call :func:`warm_up` before forking, so that the workers
inherit compiled kernels instead of loading them for every message.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

__all__ = ["MIN_NUMEL", "available", "jit_kernels", "set_jit", "warm_up"]

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
                from fedddl.compression import kernels
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


def warm_up() -> bool:
    """Compile (or load from numba's cache) every kernel now, by encoding and decoding a
    small tensor with each ternary codec and summing one in lanes; returns whether the
    kernels are available.

    Changes no setting: the :func:`set_jit` mode in force is restored.
    """
    global _mode
    if _mode is False or _load() is None:
        return False
    import numpy as np
    import torch

    from fedddl.compression.registry import make_compressor
    from fedddl.compression.wire import decode_update, encode_update

    assert _kernels is not None
    _kernels.lane_statistics(np.zeros(64, dtype=np.float32), np.zeros((3, _kernels.LANES)))
    saved = _mode
    _mode = True
    try:
        for name in ("ternary", "ternary-base3"):  # the 2-bit and the base-3 kernels
            compressor = make_compressor(name, seed=0, clip_sigma=2.5)
            decode_update(encode_update({"w": torch.linspace(-1.0, 1.0, 64)}, compressor))
    finally:
        _mode = saved
    return True
