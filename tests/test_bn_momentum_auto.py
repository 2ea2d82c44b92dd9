"""``bn-momentum = "auto"`` (the default): BatchNorm momentum 0.5 with sampled clients, the
model's own at full participation; explicit values used as given."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
from torch import nn

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.bn_momentum_choice import (
    AUTO,
    MODEL_OWN,
    SAMPLED_MOMENTUM,
    parse_bn_momentum,
    resolve_bn_momentum,
)
from fedddl.commands import simulate
from fedddl.flower.inline_grid import InlineGrid
from strategies.server_app import _choices_resolved, run_server


@pytest.mark.parametrize(
    ("value", "fraction", "expected"),
    [
        (AUTO, 1.0, MODEL_OWN),  # full participation: the model's own, as before
        (AUTO, 0.1, SAMPLED_MOMENTUM),
        (AUTO, 0.99, SAMPLED_MOMENTUM),
        (AUTO, 0.01, SAMPLED_MOMENTUM),
        (0.0, 0.1, 0.0),
        (0.3, 0.1, 0.3),
        (0.3, 1.0, 0.3),
        (1.0, 1.0, 1.0),
        ("0.2", 0.5, 0.2),
    ],
)
def test_auto_resolves_by_fraction_and_explicit_values_stay(
    value: float | str, fraction: float, expected: float
) -> None:
    assert resolve_bn_momentum(value, fraction_train=fraction) == expected


def test_the_sampled_momentum_is_in_range_and_not_the_models_own() -> None:
    assert 0 < SAMPLED_MOMENTUM <= 1 and SAMPLED_MOMENTUM != 0.1


@pytest.mark.parametrize(
    ("value", "expected"), [(AUTO, AUTO), ("0.5", 0.5), (0, 0.0), (1, 1.0), (0.25, 0.25)]
)
def test_parse_takes_auto_and_numbers_in_range(value: object, expected: float | str) -> None:
    assert parse_bn_momentum(value) == expected


@pytest.mark.parametrize("value", ["fast", "", -0.1, 1.5, True, None, math.nan, "inf"])
def test_parse_refuses_anything_else_naming_the_choices(value: object) -> None:
    with pytest.raises(ValueError, match="bn-momentum must be 'auto', 0"):
        parse_bn_momentum(value)


def _momenta(cfg: AppConfig) -> set[float | None]:
    model = cfg.model_factory()()
    return {m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm2d)}


def test_the_config_default_is_auto_and_the_models_follow_the_resolved_value() -> None:
    assert AppConfig().bn_momentum == AUTO
    assert AppConfig(arch="resnet8").resolved_bn_momentum == MODEL_OWN
    assert _momenta(AppConfig(arch="resnet8")) == {0.1}
    assert _momenta(AppConfig(arch="resnet8", fraction_train=0.1)) == {SAMPLED_MOMENTUM}
    assert _momenta(AppConfig(arch="resnet8", fraction_train=0.1, bn_momentum=0.0)) == {0.1}
    assert _momenta(AppConfig(arch="resnet8", bn_momentum=0.3)) == {0.3}


@pytest.mark.parametrize("value", [AUTO, 0.3, "0.3", 0])
def test_the_run_config_round_trips(value: object) -> None:
    cfg = AppConfig.from_run_config({"bn-momentum": value, "fraction-train": 0.5})
    assert AppConfig.from_run_config(cfg.to_run_config()) == cfg
    assert cfg.resolved_bn_momentum == resolve_bn_momentum(
        parse_bn_momentum(value), fraction_train=0.5
    )
    with pytest.raises(ValueError, match="bn-momentum"):
        AppConfig.from_run_config({"bn-momentum": "quick"})


def test_the_command_line_takes_auto_numbers_and_refuses_the_rest() -> None:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    assert parser.parse_args([]).bn_momentum == AUTO
    assert parser.parse_args(["--bn-momentum", "0.3"]).bn_momentum == 0.3
    assert parser.parse_args(["--bn-momentum", "auto"]).bn_momentum == AUTO
    with pytest.raises(SystemExit):
        parser.parse_args(["--bn-momentum", "2"])
    help_text = parser.format_help()
    assert "default: auto" in " ".join(help_text.split())


def test_a_resume_compares_the_resolved_momentum() -> None:
    sampled = {"fraction-train": 0.1}
    assert _choices_resolved({**sampled, "bn-momentum": AUTO})["bn-momentum"] == SAMPLED_MOMENTUM
    assert _choices_resolved({**sampled, "bn-momentum": 0.5})["bn-momentum"] == 0.5
    # a checkpoint older than the key, or than "auto", ran with the model's own
    assert _choices_resolved(sampled)["bn-momentum"] == MODEL_OWN
    assert _choices_resolved({"bn-momentum": AUTO})["bn-momentum"] == MODEL_OWN
    assert _choices_resolved({"bn-momentum": 0.0})["bn-momentum"] == MODEL_OWN


def _run(**settings: Any) -> dict[str, Any]:
    cfg = AppConfig(
        dataset="digits", arch="resnet8", num_server_rounds=3, min_available_nodes=10,
        eval_every=3, **settings,
    )
    return run_server(InlineGrid(make_client_app(cfg), 10), cfg, progress=lambda _: None)


def test_a_sampled_run_by_default_is_the_run_with_the_sampled_momentum() -> None:
    auto = _run(fraction_train=0.3)
    explicit = _run(fraction_train=0.3, bn_momentum=SAMPLED_MOMENTUM)
    own = _run(fraction_train=0.3, bn_momentum=0.0)
    assert auto["config"]["bn-momentum"] == AUTO
    assert auto["config"]["resolved-bn-momentum"] == SAMPLED_MOMENTUM
    assert own["config"]["resolved-bn-momentum"] == MODEL_OWN
    assert all(r["replicas_equal"] for r in auto["rounds"])
    assert auto["final_fingerprint"] == explicit["final_fingerprint"] is not None
    assert own["final_fingerprint"] != auto["final_fingerprint"]  # the running statistics
    for key in ("bytes_up", "bytes_down"):
        assert [r[key] for r in auto["rounds"]] == [r[key] for r in own["rounds"]]
