"""Opt-in: let glibc reuse freed large blocks instead of returning them to the kernel.

Every message of a large model is a new ``bytes`` object (and every decoded
tensor a new tensor).  glibc serves blocks above its mmap threshold (at most
32 MiB by default) with a fresh ``mmap`` and unmaps them when freed, so each
round's message first-touches every 4 KiB page again; the kernel's page
faults, not the copy, then bound encode and decode speed (``fedddl bench
compression`` shows it: a fresh ``clone()`` against a warm ``copy_``).

:func:`keep_freed_memory` raises glibc's mmap and trim thresholds so freed
blocks stay in the heap and the next message of the same size reuses warm
pages.  The process then keeps its peak heap instead of returning it: call it
in a long-running worker or server that sends large messages every round, not
in a library.  It changes no result.
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
