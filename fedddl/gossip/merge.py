"""Merging a received model into the local one (gossip averaging)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["merge_models", "version_weight"]


def merge_models(
    local: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    weight: float = 0.5,
) -> dict[str, torch.Tensor]:
    """Return ``(1 - weight) * local + weight * received`` for every tensor.

    Parameters
    ----------
    local, received
        State dicts with the same names, shapes and dtypes.
    weight
        Share of the received model, in ``[0, 1]``; ``0.5`` is plain averaging.

    Returns
    -------
    dict
        New tensors (inputs are not modified).  Non-floating tensors (counters
        such as ``num_batches_tracked``) are not averaged: the larger value is kept.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    if set(local) != set(received):
        missing = sorted(set(local) ^ set(received))
        raise ValueError(f"models differ in tensor names: {missing}")
    merged: dict[str, torch.Tensor] = {}
    for name, mine in local.items():
        theirs = received[name]
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            raise ValueError(
                f"tensor {name!r}: local {tuple(mine.shape)} {mine.dtype} vs received"
                f" {tuple(theirs.shape)} {theirs.dtype}"
            )
        if mine.is_floating_point():
            merged[name] = torch.lerp(mine, theirs, weight)
        else:
            merged[name] = torch.maximum(mine, theirs)
    return merged


def version_weight(local_version: int, received_version: int) -> float:
    """Age-aware merge weight: the received model's share of the combined step clocks.

    ``received / (local + received)``, or ``0.5`` when both are 0 -- a newer
    model (larger clock) counts more, as in age-weighted gossip averaging.
    """
    if local_version < 0 or received_version < 0:
        raise ValueError(
            f"versions must be >= 0, got local={local_version} received={received_version}"
        )
    total = local_version + received_version
    return 0.5 if total == 0 else received_version / total
