"""Your own model and data in a fedddl run: a tested example.

Put this module where the server and every client can import it (on ``PYTHONPATH``, or in
your package) and name its functions in the run config::

    flwr run . local --run-config "model='my_task:small_bn_cnn' dataset='my_task:blobs'"
    fedddl simulate --model my_task:small_bn_cnn --dataset my_task:blobs

``model``: ``factory(input_shape, num_classes) -> torch.nn.Module``. fedddl calls it under
a seeded RNG, so the server and every client build identical weights. BatchNorm layers
are fine: their statistics travel with the gradients (see docs/training.md).

``dataset``: ``loader(split, root) -> (images N×C×H×W float32, labels N int64)`` for
``split`` ``"train"`` and ``"test"``; it must return the same data wherever it runs.
fedddl shards the training split (stratified by default) and evaluates on the test split.
"""

from __future__ import annotations

import torch
from torch import nn


def small_bn_cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Conv(8) → BatchNorm → ReLU → Conv(16) → BatchNorm → ReLU → global pool → Linear."""
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


def blobs(split: str, root: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """4 classes of 3×12×12 images whose mean colour depends on the class (seeded)."""
    del root  # a real loader reads its files from here
    count = 240 if split == "train" else 80
    gen = torch.Generator().manual_seed(0 if split == "train" else 1)
    labels = torch.arange(count) % 4
    colours = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.5, 0.5, 0.5]])
    noise = 0.2 * torch.randn(count, 3, 12, 12, generator=gen)
    images = colours[labels].view(count, 3, 1, 1) + noise
    return images.float(), labels.long()
