"""``StratifiedPartitioner``: distribution-preserving partitions for Flower Datasets.

A :class:`flwr_datasets.partitioner.Partitioner` built on
:func:`fedddl.partition.stratified_shards` (scikit-learn ``StratifiedKFold``): partition
``k`` is fold ``k``'s test indices, so every partition keeps the global class
proportions (per class, a partition's count is the floor or the ceiling of
``count / num_partitions``)::

    from flwr_datasets import FederatedDataset
    from fedddl.flower.stratified_partitioner import StratifiedPartitioner

    fds = FederatedDataset(
        dataset="ylecun/mnist", partitioners={"train": StratifiedPartitioner(10)}
    )
    partition = fds.load_partition(0)

This module needs the optional ``flwr-datasets`` package (``pip install
'fedddl[datasets]'``); the rest of fedddl does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import Partitioner

from fedddl.partition import stratified_shards

__all__ = ["StratifiedPartitioner"]


class StratifiedPartitioner(Partitioner):  # type: ignore[misc]
    """Partitions that each keep the class proportions of the whole dataset.

    Parameters
    ----------
    num_partitions : int
        Number of partitions, at least 1 and at most the smallest class count.
    partition_by : str
        Column holding the class of each row (integers or strings).
    seed : int
        Shuffling seed of ``StratifiedKFold``; the same seed gives the same partitions.

    Raises
    ------
    ValueError
        At construction for ``num_partitions < 1``; when the partitions are first
        computed, for a missing column, or more partitions than the rarest class has rows.
    """

    def __init__(self, num_partitions: int, partition_by: str = "label", seed: int = 0) -> None:
        super().__init__()
        if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
            raise TypeError(f"num_partitions must be an int, got {type(num_partitions).__name__}")
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
        self._num_partitions = num_partitions
        self._partition_by = partition_by
        self._seed = seed
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        """Total number of partitions."""
        return self._num_partitions

    @property
    def partition_id_to_indices(self) -> dict[int, list[int]]:
        """Row indices (into the assigned dataset, sorted) of every partition."""
        return {k: shard.tolist() for k, shard in enumerate(self._shards())}

    def load_partition(self, partition_id: int) -> Dataset:
        """Return partition ``partition_id`` (rows in dataset order).

        Raises
        ------
        ValueError
            If ``partition_id`` is not in ``[0, num_partitions)``.
        """
        if isinstance(partition_id, bool) or not 0 <= int(partition_id) < self._num_partitions:
            raise ValueError(
                f"partition_id must be in [0, {self._num_partitions}), got {partition_id!r}"
            )
        return self.dataset.select(self._shards()[int(partition_id)])

    def _shards(self) -> list[np.ndarray]:
        if self._indices is None:
            dataset: Any = self.dataset
            if self._partition_by not in dataset.column_names:
                raise ValueError(
                    f"partition_by={self._partition_by!r} is not a column of the dataset "
                    f"(columns: {', '.join(dataset.column_names)})"
                )
            labels = np.asarray(dataset.with_format("numpy")[self._partition_by])
            # any hashable class values (ints, strings) -> class ids 0..C-1
            _, class_ids = np.unique(labels, return_inverse=True)
            self._indices = stratified_shards(
                class_ids.reshape(-1), self._num_partitions, seed=self._seed
            )
        return self._indices
