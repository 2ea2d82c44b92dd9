"""Opt-in: let glibc keep freed large blocks in the heap (raised mmap and trim
thresholds), so that each round's large message reuses warm pages instead of faulting in
fresh ones. The process then keeps its peak heap: call :func:`keep_freed_memory` in a
long-running worker or server, not in a library. It changes no result.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(threshold: int = 1 << 30) -> bool:
    """Serve blocks below ``threshold`` bytes from the heap and never trim it below that.

    Returns
    -------
    bool
        Whether it took effect (``False`` where the C library is not glibc).
    """
    if threshold < 1:
        raise ValueError(f"threshold must be positive, got {threshold}")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    limit = min(threshold, (1 << 31) - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, limit)) and bool(mallopt(_M_TRIM_THRESHOLD, limit))
