"""The client's data shard, loaded once per process and cached."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch

from fedddl.app_config import AppConfig

__all__ = ["load_shard", "partition_of"]


def partition_of(node_config: Mapping[str, Any]) -> tuple[int, int]:
    """Return ``(partition-id, num-partitions)`` from a node config.

    Raises
    ------
    ValueError
        If the keys are missing or out of range.
    """
    try:
        pid, num = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"node_config lacks {err.args[0]!r} (need partition-id, num-partitions)"
        ) from None
    if not 0 <= pid < num:
        raise ValueError(f"partition-id {pid} is not in [0, num-partitions={num})")
    return pid, num


@lru_cache(maxsize=8)
def _shards(
    dataset: str, root: str, method: str, num: int, seed: int, alpha: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    from fedddl.data import as_tensors, load_dataset
    from fedddl.partition import make_shards

    x, y = as_tensors(load_dataset(dataset, root or None, split="train"))
    shards = make_shards(method, y.numpy(), num, seed=seed, alpha=alpha)
    return x, y, tuple(torch.as_tensor(s, dtype=torch.int64) for s in shards)


def load_shard(
    cfg: AppConfig, partition_id: int, num_partitions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x, y)`` of shard ``partition_id`` of the training split, on the run's device.

    Cached per process (one copy per device), so a round copies no data.
    """
    return _shard(
        cfg.dataset,
        cfg.data_root,
        cfg.partition,
        num_partitions,
        cfg.seed,
        cfg.dirichlet_alpha,
        partition_id,
        cfg.device,
    )


@lru_cache(maxsize=256)
def _shard(
    dataset: str,
    root: str,
    method: str,
    num: int,
    seed: int,
    alpha: float,
    partition_id: int,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    from fedddl.devices import resolve_device

    x, y, shards = _shards(dataset, root, method, num, seed, alpha)
    idx = shards[partition_id]
    if idx.numel() == 0:
        raise ValueError(f"shard {partition_id} of {num} is empty")
    target = resolve_device(device)
    return x[idx].to(target), y[idx].to(target)
