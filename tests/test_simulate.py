"""``fedddl simulate`` end to end on Ray (one module-scoped run), checked against the
in-process InlineGrid run of the same config: replicas in separate Ray worker
processes follow the server's shadow replica bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from fedddl.app_config import AppConfig
from fedddl.cli import main

ARGS = [
    "--strategy",
    "terngrad",
    "--num-clients",
    "3",
    "--rounds",
    "3",
    "--seed",
    "1",
    "--lr",
    "0.2",
    "--quiet",
    # any run-config key, in Flower's syntax, over the shortcut flags (--lr 0.2 above)
    "--run-config",
    "min-replies=2 learning-rate=0.25",
]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sim") / "result.json"
    os.environ.setdefault("FLWR_HOME", str(tmp_path_factory.mktemp("flwr_home")))
    assert main(["simulate", *ARGS, "--out", str(out)]) == 0
    result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


@pytest.mark.slow
def test_json_has_the_documented_fields(simulated: dict[str, Any]) -> None:
    assert simulated["config"]["strategy"] == "terngrad"
    assert simulated["config"]["min-replies"] == 2  # set only through --run-config
    assert simulated["config"]["learning-rate"] == 0.25  # --run-config wins over --lr
    assert simulated["config"]["num-clients"] == 3
    rounds = simulated["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert {
            "round",
            "accuracy",
            "loss",
            "bytes_up",
            "bytes_down",
            "replicas_equal",
            "wall_s",
        } <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["loss"] > 0
        assert r["replicas_equal"] is True and r["accepted"] == 3
        assert r["bytes_up"] > 0 and r["wall_s"] > 0
    assert rounds[0]["bytes_down"] < rounds[1]["bytes_down"]  # round 1 carries no update
    assert simulated["final_accuracy"] == rounds[-1]["accuracy"]


@pytest.mark.slow
def test_ray_run_matches_the_in_process_run_exactly(simulated: dict[str, Any]) -> None:
    from clients.client_app import make_client_app
    from strategies.server_app import run_server
    from tests.support.inline_grid import InlineGrid

    cfg = AppConfig(
        num_server_rounds=3, seed=1, learning_rate=0.25, min_replies=2, min_available_nodes=2
    )
    local = run_server(InlineGrid(make_client_app(cfg), 3), cfg, progress=lambda _: None)
    for ray_round, inline_round in zip(simulated["rounds"], local["rounds"], strict=True):
        assert ray_round["accuracy"] == inline_round["accuracy"]
        assert ray_round["loss"] == inline_round["loss"]
        assert ray_round["bytes_up"] == inline_round["bytes_up"]
        assert ray_round["bytes_down"] == inline_round["bytes_down"]


def test_bad_arguments_exit_2_without_running() -> None:
    assert main(["simulate", "--downlink", "reternarize", "--fraction-train", "0"]) == 2


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ("min-reply=2", "unknown config key 'min-reply'; did you mean 'min-replies'?"),
        ("rounds=5", "did you mean 'num-server-rounds'?"),
        ("strategy=fedavg", "invalid format"),  # Flower's syntax: strings in quotes
        ("seed", "'seed' is not a key=value pair"),
        ("batch-size='big'", "config key 'batch-size' must be an integer"),
    ],
)
def test_bad_run_config_names_the_problem_without_running(
    run_config: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--run-config", run_config]) == 2
    assert message in capsys.readouterr().err
