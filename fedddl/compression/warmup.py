"""Compile the numba kernels now, before a process forks workers that would each load
them (about a second per fresh process)."""

from __future__ import annotations

import numpy as np
import torch

from fedddl.compression.algorithms.registry import make_compressor
from fedddl.compression.backends import jit
from fedddl.compression.codecs.wire import decode_update, encode_update

__all__ = ["warm_up"]


def warm_up() -> bool:
    """Compile (or load from numba's cache) every kernel now, by encoding and decoding a
    small tensor with each ternary codec and summing one in lanes; returns whether the
    kernels are available.

    Changes no setting: the :func:`~fedddl.compression.backends.jit.set_jit` mode in force
    is restored.
    """
    kernels = jit.loaded_kernels()
    if kernels is None:
        return False
    kernels.lane_statistics(np.zeros(64, dtype=np.float32), np.zeros((3, kernels.LANES)))
    saved = jit.mode()
    jit.set_jit(True)
    try:
        for name in ("ternary", "ternary-base3"):  # the 2-bit and the base-3 kernels
            compressor = make_compressor(name, seed=0, clip_sigma=2.5)
            decode_update(encode_update({"w": torch.linspace(-1.0, 1.0, 64)}, compressor))
    finally:
        jit.set_jit(saved)
    return True
