"""The client side of the ``grid`` downlink: follow an instruction's snapshot or catch-up."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedddl.sync.grid import GridError
from fedddl.sync.grid_replica import GridReplica
from fedddl.sync.grid_shadow import SNAPSHOT_KEY
from fedddl.sync.messages import TrainInstruction

__all__ = ["reach_grid_version"]


def _snapshot_bytes(snapshot: dict[str, torch.Tensor]) -> bytes:
    data = snapshot.get(SNAPSHOT_KEY)
    if (
        list(snapshot) != [SNAPSHOT_KEY]
        or data is None
        or data.dtype != torch.uint8
        or data.dim() != 1
    ):
        raise GridError(
            f"grid snapshot: expected one 1-D uint8 entry {SNAPSHOT_KEY!r}, got {list(snapshot)}"
        )
    return data.numpy().tobytes()


def reach_grid_version(
    held: GridReplica | None,
    instruction: TrainInstruction,
    model_fn: Callable[[], nn.Module],
) -> GridReplica | None:
    """The replica to keep after the instruction's snapshot or catch-up (``held`` unless
    replaced; None: none yet). A catch-up from another version than the replica's is
    ignored (the caller answers ``resync``); a client with no replica starts from the seeded
    model at version 0.

    Raises
    ------
    GridError
        A snapshot or catch-up that does not decode or apply; ``held`` is unchanged.
    """
    if instruction.snapshot is not None:
        fresh = GridReplica(model_fn())
        fresh.load_snapshot_bytes(_snapshot_bytes(instruction.snapshot))
        if fresh.version != instruction.snapshot_version:
            raise GridError(
                f"grid snapshot: at version {fresh.version}, the message says "
                f"{instruction.snapshot_version}"
            )
        held = fresh
    elif held is None and instruction.model_version == 0 and not instruction.updates:
        held = GridReplica(model_fn())
    for version, data in instruction.updates:
        if held is not None and version <= held.version:
            continue
        replica = held if held is not None else GridReplica(model_fn())
        if replica.apply_catch_up(data):
            held = replica
    return held
