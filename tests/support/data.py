"""A small user dataset for the tests, loaded through ``dataset = "module:loader"``."""

from __future__ import annotations

import torch


def blobs(split: str, root: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """4 classes of 3×12×12 images whose mean colour depends on the class (seeded)."""
    del root
    count = 240 if split == "train" else 80
    gen = torch.Generator().manual_seed(0 if split == "train" else 1)
    labels = torch.arange(count) % 4
    colours = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.5, 0.5, 0.5]])
    noise = 0.2 * torch.randn(count, 3, 12, 12, generator=gen)
    images = colours[labels].view(count, 3, 1, 1) + noise
    return images.float(), labels.long()
