"""The common base class of every dataset returned by :func:`fedddl.data.load_dataset`."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch.utils.data import Dataset

__all__ = ["LabelledImageDataset"]


class LabelledImageDataset(Dataset[tuple[torch.Tensor, int]], ABC):
    """A sized dataset of ``(float32 C×H×W image, int label)`` with a ``targets`` list.

    It exists so that ``len(dataset)`` and ``dataset.targets`` are typed for callers.
    """

    targets: list[int]

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Return ``(image, label)`` of sample ``index``."""
