"""A model factory that returns something else, for the error test."""

from __future__ import annotations


def not_a_model(input_shape: tuple[int, int, int], num_classes: int) -> object:
    """Not an ``nn.Module``."""
    return [input_shape, num_classes]
