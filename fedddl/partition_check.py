"""Refuse, before a run starts, a data split its clients could not build."""

from __future__ import annotations

from fedddl.app_config import AppConfig
from fedddl.partition import PartitionError, check_shardable

__all__ = ["check_run_partition"]


def check_run_partition(cfg: AppConfig, num_clients: int) -> None:
    """Raise unless ``cfg.partition`` splits ``cfg.dataset``'s training set into ``num_clients``.

    Every client builds the same shards from ``(partition, num-partitions)``; a split that
    cannot exist would otherwise fail inside each client, and the run would go on with every
    reply dropped.

    Raises
    ------
    PartitionError
        If the split cannot exist; the message names the dataset, the client count and the
        smallest class count (stratified), and suggests ``partition = "random"``.
    """
    from fedddl.data import get_labels, load_dataset

    labels = get_labels(load_dataset(cfg.dataset, cfg.data_root or None, split="train"))
    try:
        check_shardable(cfg.partition, labels, num_clients)
    except PartitionError as err:
        raise PartitionError(
            f"partition = {cfg.partition!r} cannot split the {cfg.dataset} training set "
            f"({labels.size} samples) over {num_clients} clients: {err}"
        ) from None
