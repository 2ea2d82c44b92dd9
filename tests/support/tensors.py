"""Test tensors shaped like model deltas."""

from __future__ import annotations

import torch


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    """``n`` cubed standard normal values: heavy tails, like model deltas."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator) ** 3
