"""``downlink = "auto"`` (the default): grid for sampled TernGrad, reternarize otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.checkpoint import CheckpointError
from fedddl.downlink_choice import resolve_downlink
from fedddl.flower.inline_grid import InlineGrid
from strategies.server_app import run_server


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, "reternarize"),  # full participation: unchanged
        ({"fraction_train": 0.1}, "grid"),
        ({"fraction_train": 0.99}, "grid"),
        ({"strategy": "gradient-average", "fraction_train": 0.1}, "reternarize"),
        ({"strategy": "fedavg", "fraction_train": 0.1}, "reternarize"),
        ({"downlink": "reternarize", "fraction_train": 0.1}, "reternarize"),
        ({"downlink": "shared-scale-sum", "fraction_train": 0.1}, "shared-scale-sum"),
        ({"downlink": "grid"}, "grid"),
    ],
)
def test_auto_resolves_by_strategy_and_fraction(settings: dict[str, Any], expected: str) -> None:
    cfg = AppConfig(**settings)
    assert cfg.resolved_downlink == expected
    assert AppConfig().downlink == "auto"
    assert AppConfig.from_run_config(cfg.to_run_config()).resolved_downlink == expected


def test_module_class_strategies_get_reternarize() -> None:
    assert resolve_downlink("auto", strategy="pkg.mod:Cls", fraction_train=0.1) == "reternarize"


def test_an_unknown_downlink_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="downlink must be one of auto, reternarize, "):
        AppConfig(downlink="automatic")


def _run(**settings: Any) -> dict[str, Any]:
    cfg = AppConfig(
        dataset="digits", num_server_rounds=4, min_available_nodes=10, eval_every=4, **settings
    )
    return run_server(InlineGrid(make_client_app(cfg), 10), cfg, progress=lambda _: None)


def test_a_sampled_terngrad_run_by_default_is_the_grid_run() -> None:
    auto, grid = _run(fraction_train=0.3), _run(fraction_train=0.3, downlink="grid")
    assert auto["config"]["resolved-downlink"] == "grid"
    assert [r["downlink_format"] for r in auto["rounds"]] == ["grid"] * 4
    assert all(r["replicas_equal"] for r in auto["rounds"])
    for key in ("bytes_up", "bytes_down"):
        assert [r[key] for r in auto["rounds"]] == [r[key] for r in grid["rounds"]]
    assert auto["final_fingerprint"] == grid["final_fingerprint"] is not None


def test_a_full_participation_run_by_default_is_the_reternarize_run() -> None:
    auto, usual = _run(), _run(downlink="reternarize")
    assert auto["config"]["resolved-downlink"] == "reternarize"
    assert "grid" not in {r["downlink_format"] for r in auto["rounds"]}
    assert [r["bytes_down"] for r in auto["rounds"]] == [r["bytes_down"] for r in usual["rounds"]]
    assert auto["final_fingerprint"] == usual["final_fingerprint"] is not None


def test_a_resume_compares_the_downlink_the_runs_use(tmp_path: Path) -> None:
    def run(path: str, rounds: int, **settings: Any) -> dict[str, Any]:
        cfg = AppConfig(
            dataset="digits",
            num_server_rounds=rounds,
            min_available_nodes=10,
            checkpoint_dir=str(tmp_path / path),
            checkpoint_every=2,
            **settings,
        )
        return run_server(InlineGrid(make_client_app(cfg), 10), cfg, progress=lambda _: None)

    # saved as "reternarize" at full participation: "auto" means the same
    run("a", 2, downlink="reternarize")
    assert run("a", 3)["resumed_from"]["round"] == 2
    # saved as "grid" with clients sampled: "auto" means the same
    run("b", 2, downlink="grid", fraction_train=0.5)
    assert run("b", 3, fraction_train=0.5)["resumed_from"]["round"] == 2
    # saved as "reternarize" with clients sampled: "auto" would switch to the grid
    run("c", 2, downlink="reternarize", fraction_train=0.5)
    with pytest.raises(CheckpointError, match="downlink: checkpoint 'reternarize', run 'grid'"):
        run("c", 3, fraction_train=0.5)
