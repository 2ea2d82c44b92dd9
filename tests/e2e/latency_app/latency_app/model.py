"""The probe's model and synthetic data (identical on server and clients)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["make_data", "make_model"]


def make_model(seed: int = 0) -> nn.Module:
    """A 64-32-10 MLP with seeded weights."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def make_data(seed: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Separable synthetic 10-class data: label = argmax of a fixed projection."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=generator)
    projection = torch.randn(64, 10, generator=torch.Generator().manual_seed(1234))
    return x, (x @ projection).argmax(dim=1)
