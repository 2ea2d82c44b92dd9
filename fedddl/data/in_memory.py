"""A map-style dataset over image and label tensors held in memory."""

from __future__ import annotations

import torch

from fedddl.data.labelled import LabelledImageDataset

__all__ = ["InMemoryImageDataset"]


class InMemoryImageDataset(LabelledImageDataset):
    """Images ``N×C×H×W`` (float32) and labels ``N`` (int64) kept as tensors.

    Parameters
    ----------
    images : torch.Tensor
        Float32 tensor of shape ``(N, C, H, W)``.
    labels : torch.Tensor
        Int64 tensor of shape ``(N,)``.
    name : str
        Dataset name, for ``repr`` only.

    Raises
    ------
    ValueError
        If shapes or dtypes are not as described.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, name: str = "") -> None:
        if images.ndim != 4:
            raise ValueError(f"images must be N×C×H×W, got shape {tuple(images.shape)}")
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise ValueError(
                f"labels must be 1-D with {images.shape[0]} entries, got shape "
                f"{tuple(labels.shape)}"
            )
        if images.dtype != torch.float32:
            raise ValueError(f"images must be float32, got {images.dtype}")
        if labels.dtype != torch.int64:
            raise ValueError(f"labels must be int64, got {labels.dtype}")
        self.images = images
        self.labels = labels
        self.name = name
        # A plain list keeps `targets` a sequence of Python ints, as the contract says.
        self.targets: list[int] = labels.tolist()

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], self.targets[index]

    def __repr__(self) -> str:
        shape = "×".join(str(s) for s in self.images.shape[1:])
        return f"InMemoryImageDataset(name={self.name!r}, size={len(self)}, image={shape})"
