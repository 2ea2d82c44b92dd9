"""Small user-defined models for the tests, loaded through ``model = "module:factory"``."""

from __future__ import annotations

from torch import nn


def tiny_bn_cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
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


def not_a_model(input_shape: tuple[int, int, int], num_classes: int) -> object:
    """A factory that returns something else (for the error test)."""
    return [input_shape, num_classes]
