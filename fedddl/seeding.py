"""Seeds derived from a run's seed, identical in every process.

The server and every client derive the seeds of sampling, compressors and minibatch
streams from the run seed, the global round and the partition, so a run (and a resumed
run) replays exactly, whatever process serves a client.
"""

from __future__ import annotations

__all__ = ["derive_seed"]


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (stable across processes and platforms)."""
    acc = 0x9E3779B97F4A7C15
    for p in parts:
        acc = (acc ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        acc ^= acc >> 31
    return acc & 0x7FFFFFFFFFFFFFFF
