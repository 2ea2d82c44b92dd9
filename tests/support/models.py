"""Model factories for tests: one that returns something else (the error test) and a tiny
BatchNorm model (integer ``num_batches_tracked`` buffer in its state)."""

from __future__ import annotations

import math

from torch import nn


def not_a_model(input_shape: tuple[int, int, int], num_classes: int) -> object:
    """Not an ``nn.Module``."""
    return [input_shape, num_classes]


def tiny_bn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Flatten, 16 hidden units with BatchNorm, ``num_classes`` outputs."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, num_classes),
    )
