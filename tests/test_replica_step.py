"""Replica.apply_update's SGD step against torch.optim.SGD, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedddl.lr_decay import StepDecay
from fedddl.replica import Replica


def _torch_sgd_steps(
    model: nn.Module, updates: list[dict[str, torch.Tensor]], lr: float, momentum: float,
    decay: StepDecay, nesterov: bool = False,
) -> nn.Module:
    """The reference: torch's own SGD, the updates as gradients, the decayed rate per step."""
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=momentum, nesterov=nesterov, foreach=False
    )
    for version, update in enumerate(updates, start=1):
        for name, param in model.named_parameters():
            param.grad = update[name].clone()
        for group in optimizer.param_groups:
            group["lr"] = decay.rate(lr, version)
        optimizer.step()
    return model


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_apply_update_equals_torch_sgd(momentum: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    updates = [
        {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
        for _ in range(6)
    ]
    decay = StepDecay((3,), 0.5)
    replica = Replica(copy.deepcopy(model), 0.1, momentum, lr_decay=decay)
    for version, update in enumerate(updates, start=1):
        replica.apply_update(update, version)
    reference = _torch_sgd_steps(copy.deepcopy(model), updates, 0.1, momentum, decay)
    pairs = zip(replica.model.named_parameters(), reference.parameters(), strict=True)
    for (name, mine), theirs in pairs:
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
        assert mine.grad is None
    buffers = [replica.optimizer.state[p].get("momentum_buffer") for p in replica._params.values()]
    assert all(b is not None for b in buffers) == (momentum != 0)
    assert updates[0]["0.weight"].abs().sum() > 0  # the update tensors were not consumed
    assert all(g["lr"] == 0.1 for g in replica.optimizer.param_groups)  # base rate kept


def test_an_optimiser_that_is_not_plain_sgd_takes_its_own_step() -> None:
    """A restored optimiser with other settings (here Nesterov) is stepped by torch itself."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    updates = [{n: torch.full(p.shape, 0.5) for n, p in model.named_parameters()}] * 3
    replica = Replica(copy.deepcopy(model), 0.1, 0.9)
    for group in replica.optimizer.param_groups:
        group["nesterov"] = True
    for version, update in enumerate(updates, start=1):
        replica.apply_update(update, version)
    reference = _torch_sgd_steps(copy.deepcopy(model), updates, 0.1, 0.9, StepDecay(), True)
    for mine, theirs in zip(replica.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
