"""Fashion-MNIST pairs: a 100-class set built from real images, for many-class experiments.

Each example puts two Fashion-MNIST images of the same split side by side (``1×28×56``)
and is labelled ``10 × left class + right class``: 100 classes of about 600 training
images each. Image ``i`` is the left half of example ``i``; its right half is image
``partner[i]`` of a fixed permutation (seed 0 for train, 1 for test), so the set is the
same everywhere and every source image appears once on each side.

Its purpose is the sharding claim: with 100 classes a shard of a few hundred examples
drawn at random misses whole classes, which 10-class data never shows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedddl.data.in_memory import InMemoryImageDataset

__all__ = ["PAIR_SEEDS", "load_fashion_mnist_pairs", "make_pairs"]

#: Permutation seed of each split.
PAIR_SEEDS = {"train": 0, "test": 1}


def make_pairs(
    images: torch.Tensor, labels: torch.Tensor, num_classes: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair every image with a partner of a seeded permutation.

    ``images`` ``N×C×H×W`` with ``labels`` ``N`` in ``[0, num_classes)`` give ``N×C×H×2W``
    images and labels ``num_classes × left + right`` (``num_classes ** 2`` classes); ``seed``
    picks each image's right-hand partner.
    """
    partner = torch.from_numpy(np.random.default_rng(seed).permutation(images.shape[0]))
    pixels = torch.cat([images, images[partner]], dim=-1)
    return pixels.contiguous(), labels * num_classes + labels[partner]


def load_fashion_mnist_pairs(root: Path, split: str, download: bool) -> InMemoryImageDataset:
    """Load the ``fashion-mnist-pairs`` split (from Fashion-MNIST's files, see :mod:`.mnist`)."""
    from fedddl.data.mnist import load_mnist_like

    source = load_mnist_like("fashion-mnist", root, split, download)
    pixels, targets = make_pairs(source.images, source.labels, 10, PAIR_SEEDS[split])
    return InMemoryImageDataset(pixels, targets, name="fashion-mnist-pairs")
