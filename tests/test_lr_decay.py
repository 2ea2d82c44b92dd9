"""Learning-rate step decay: the schedule, replicas against torch's SGD, and whole runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.testing import assert_close

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.flower.inline_grid import InlineGrid
from fedddl.lr_decay import StepDecay
from fedddl.models import create_model
from fedddl.replica import Replica
from strategies.server_app import run_server


def test_factor_drops_after_each_milestone() -> None:
    decay = StepDecay.parse("2, 4", 0.5)
    assert decay.milestones == (2, 4)
    assert [decay.factor(r) for r in range(1, 7)] == [1, 1, 0.5, 0.5, 0.25, 0.25]
    assert decay.rate(0.2, 5) == pytest.approx(0.05)
    assert StepDecay.parse("").rate(0.2, 1000) == 0.2


@pytest.mark.parametrize(
    ("text", "gamma", "match"),
    [
        ("200;300", 0.1, "comma-separated"),
        ("300,200", 0.1, "increase strictly"),
        ("0,10", 0.1, "rounds >= 1"),
        ("10", 0.0, "lr-gamma"),
        ("10", 1.5, "lr-gamma"),
    ],
)
def test_bad_schedules_name_the_key(text: str, gamma: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepDecay.parse(text, gamma)
    with pytest.raises(ValueError, match=match):
        AppConfig.from_run_config({"lr-milestones": text, "lr-gamma": gamma})


def test_run_config_keys_reach_the_schedule() -> None:
    cfg = AppConfig.from_run_config({"lr-milestones": "200,300", "lr-gamma": 0.2})
    assert cfg.lr_decay() == StepDecay((200, 300), 0.2)
    assert AppConfig().lr_decay().milestones == ()


def test_replica_steps_like_sgd_with_the_rate_changed_between_steps() -> None:
    torch.manual_seed(0)
    decay = StepDecay((2,), 0.1)
    replica = Replica(create_model("digits", seed=1), 0.5, 0.9, lr_decay=decay)
    reference = create_model("digits", seed=1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    for version in (1, 2, 3, 4):
        update = {n: torch.randn_like(p) for n, p in reference.named_parameters()}
        replica.apply_update(update, version)
        for group in optimizer.param_groups:
            group["lr"] = 0.5 if version <= 2 else 0.05
        for name, param in reference.named_parameters():
            param.grad = update[name].clone()
        optimizer.step()
        for (name, mine), theirs in zip(
            replica.model.named_parameters(), reference.parameters(), strict=True
        ):
            assert_close(mine, theirs, msg=f"{name} after version {version}")
    assert [g["lr"] for g in replica.optimizer.param_groups] == [0.5]  # stored rate unchanged


def _run(cfg: AppConfig, nodes: int = 3) -> dict[str, Any]:
    grid = InlineGrid(make_client_app(cfg), nodes)
    return run_server(grid, cfg.replace(min_available_nodes=nodes), progress=lambda _: None)


@pytest.mark.parametrize("strategy", ["terngrad", "fedavg"])
def test_a_run_follows_the_schedule_and_replicas_agree(strategy: str) -> None:
    base = AppConfig(num_server_rounds=4, strategy=strategy, learning_rate=0.3)
    constant = _run(base)
    decayed = _run(base.replace(lr_milestones="2", lr_gamma=1e-6))
    losses = [[r["loss"] for r in run["rounds"]] for run in (constant, decayed)]
    # the same before the milestone (FedAvg's evaluation sums vary in the 7th digit)
    assert losses[1][:2] == pytest.approx(losses[0][:2], rel=1e-6)
    assert losses[1][2:] != pytest.approx(losses[0][2:], rel=1e-4)
    # after the milestone the model all but stops: rounds 3 and 4 evaluate as round 2
    assert losses[1][3] == pytest.approx(losses[1][1], rel=1e-3)
    assert losses[0][3] != pytest.approx(losses[0][1], rel=1e-3)
    if strategy == "terngrad":
        assert all(r["replicas_equal"] for r in decayed["rounds"])
