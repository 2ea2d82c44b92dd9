"""Seeded models: an MLP for digits, a small CNN for (Fashion-)MNIST, a CIFAR ResNet-18.

All models take ``N×C×H×W`` float input and return ``N×num_classes`` logits. Weights
depend only on the seed: creation runs under a forked RNG, so the global torch RNG
state is left untouched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import lru_cache

import torch
from torch import nn

from fedddl.data.registry import dataset_info

__all__ = [
    "ARCHITECTURES",
    "DigitsMLP",
    "SmallCNN",
    "cifar_resnet18",
    "create_model",
    "seeded_model_factory",
]

ARCHITECTURES: tuple[str, ...] = ("mlp", "cnn", "resnet18")


class DigitsMLP(nn.Sequential):
    """Flatten → Linear(in, hidden) → ReLU → Linear(hidden, classes)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 64):
        super().__init__(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


class SmallCNN(nn.Sequential):
    """Two 3×3 conv blocks (16, 32 channels, each ReLU + 2×2 max-pool) and a 2-layer head."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 128):
        channels, height, width = input_shape
        if height < 4 or width < 4:
            raise ValueError(f"SmallCNN needs images of at least 4×4, got {height}×{width}")
        super().__init__(
            nn.Conv2d(channels, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * (height // 4) * (width // 4), hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


def cifar_resnet18(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with a 3×3 stride-1 stem and no max-pool (for 32×32 / 64×64).

    Note that its BatchNorm layers carry buffers (running mean/var, batch counters) that
    belong to the model state alongside the parameters.
    """
    from torchvision.models import resnet18

    model: nn.Module = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()  # type: ignore[assignment]
    return model


def create_model(dataset: str, *, seed: int, arch: str | None = None) -> nn.Module:
    """Create the model for ``dataset`` with weights determined by ``seed`` alone.

    Parameters
    ----------
    dataset : str
        One of :data:`fedddl.data.DATASETS`; fixes input shape and number of classes.
    seed : int
        Non-negative seed; the same seed gives bit-identical weights.
    arch : str, optional
        ``"mlp"``, ``"cnn"`` or ``"resnet18"``; default is the dataset's ``default_model``.

    Returns
    -------
    torch.nn.Module
        A float32 CPU model in training mode.

    Raises
    ------
    ValueError
        On an unknown dataset or architecture, or a negative seed.
    TypeError
        If ``seed`` is not an int.
    """
    info = dataset_info(dataset)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    name = info.default_model if arch is None else arch
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown arch {name!r}; expected one of {', '.join(ARCHITECTURES)}")
    # fork_rng restores the global CPU RNG afterwards, so callers' streams are unaffected.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "mlp":
            return DigitsMLP(info.input_shape, info.num_classes)
        if name == "cnn":
            return SmallCNN(info.input_shape, info.num_classes)
        return cifar_resnet18(info.input_shape, info.num_classes)


@lru_cache(maxsize=8)
def _seeded_model(dataset: str, seed: int, arch: str) -> nn.Module:
    return create_model(dataset, seed=seed, arch=arch or None)


def seeded_model_factory(dataset: str, *, seed: int, arch: str = "") -> Callable[[], nn.Module]:
    """Return the seeded model constructor shared by a server and every client.

    :func:`create_model` is deterministic in the seed, so the model is built once per
    process and each call returns a deep copy (cheaper than re-initialising).
    """

    def build() -> nn.Module:
        return copy.deepcopy(_seeded_model(dataset, seed, arch))

    return build
