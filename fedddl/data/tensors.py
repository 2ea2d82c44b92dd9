"""Labels and materialised tensors of any dataset returned by :func:`load_dataset`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from fedddl.data.in_memory import InMemoryImageDataset

__all__ = ["as_tensors", "get_labels"]


def get_labels(dataset: Dataset[Any]) -> np.ndarray:
    """Return the labels of ``dataset`` as a 1-D int64 array.

    Uses ``dataset.targets`` when present (also through ``torch.utils.data.Subset``),
    otherwise iterates over the items.
    """
    if isinstance(dataset, Subset):
        return get_labels(dataset.dataset)[np.asarray(dataset.indices, dtype=np.int64)]
    targets = getattr(dataset, "targets", None)
    if targets is None:
        targets = [int(dataset[i][1]) for i in range(len(dataset))]  # type: ignore[arg-type]
    labels = np.asarray(targets, dtype=np.int64)
    if labels.ndim != 1:
        raise ValueError(f"dataset targets must be 1-D, got shape {labels.shape}")
    return labels


def as_tensors(dataset: Dataset[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(images N×C×H×W float32, labels N int64)`` of the whole dataset.

    For in-memory datasets this returns the stored tensors without copying (do not
    modify them in place); other datasets are read item by item.
    """
    if isinstance(dataset, InMemoryImageDataset):
        return dataset.images, dataset.labels
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("cannot materialise an empty dataset")
    items = [dataset[i] for i in range(n)]
    images = torch.stack([torch.as_tensor(img, dtype=torch.float32) for img, _ in items])
    labels = torch.tensor([int(lab) for _, lab in items], dtype=torch.int64)
    return images, labels
