"""Replaying journaled broadcast updates onto a replica (clients and their saved state)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from fedddl.compression import PayloadError
from fedddl.compression.codecs.downlink import decode_broadcast_parts
from fedddl.replica import Replica, ReplicaError

__all__ = ["replay"]


def replay(
    replica: Replica,
    updates: Iterable[tuple[int, bytes]],
    *,
    out: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """Apply ``(version, encoded update)`` pairs in order; yield each one applied.

    Updates at or below the replica's version are skipped; replay stops at a gap or at the
    first update that does not decode or apply (the replica keeps the version it reached).
    ``out``: decode buffers (e.g. on the replica's device); None: fresh CPU tensors.
    """
    for version, payload in updates:
        if version <= replica.version:
            continue
        if version != replica.version + 1:
            return
        try:
            update, statistics = decode_broadcast_parts(payload, out=out)
            replica.apply_update(update, version, statistics)
        except (PayloadError, ReplicaError):
            return
        yield version, payload
