"""``simulations.bn_momenta``: side copies follow a run's pooled statistics with other momenta,
each update once, and equal a run made with that momentum."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedddl.running_stats import apply_statistics
from simulations.bn_momenta import SideMomenta


def _net(momentum: float) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3))
    net[1].momentum = momentum
    return net


def _stats(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "1.mean": torch.randn(3, generator=g),
        "1.var": torch.rand(3, generator=g) + 0.5,
        "1.count": torch.tensor([64.0]),
    }


def _buffers(net: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in net[1].buffers()]


def test_a_side_equals_a_run_with_its_momentum_and_skips_repeated_updates() -> None:
    sides = SideMomenta([0.5, 0.1])
    apply = sides.wrap(apply_statistics)
    server, client, direct = _net(0.1), _net(0.1), _net(0.5)
    updates = [_stats(r) for r in range(4)]
    for stats in updates:
        apply(server, stats)
        apply(client, copy.deepcopy(stats))  # a replica applying the same update later
        apply_statistics(direct, stats)
    assert sides.updates == 4
    x = torch.randn(2, 1, 5, 5)
    at_half = sides.with_statistics_of(server, 0.5)
    for got, want in zip(_buffers(at_half), _buffers(direct), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(
        _buffers(sides.with_statistics_of(server, 0.1)), _buffers(server), strict=True
    ):
        assert torch.equal(got, want)
    assert not torch.equal(at_half[1].running_mean, server[1].running_mean)
    assert torch.equal(at_half[0].weight, server[0].weight)  # the run's weights
    at_half.eval()
    assert at_half(x).shape == (2, 3, 3, 3)


def test_momenta_outside_their_range_are_refused() -> None:
    with pytest.raises(ValueError, match="momenta"):
        SideMomenta([0.0])
