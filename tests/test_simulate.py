"""``fedddl simulate`` end to end on both engines (one module-scoped run each): the Ray run,
replicas in separate Ray worker processes, gives the inline run's bytes, losses and final
model bit for bit."""

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
    assert main(["simulate", *ARGS, "--out", str(out)]) == 0  # --engine ray: the default
    result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


@pytest.fixture(scope="module")
def inline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("inline") / "result.json"
    assert main(["simulate", *ARGS, "--engine", "inline", "--out", str(out)]) == 0
    result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


@pytest.fixture(params=[pytest.param("ray", marks=pytest.mark.slow), "inline"])
def engine_result(request: pytest.FixtureRequest) -> dict[str, Any]:
    result: dict[str, Any] = request.getfixturevalue(
        "simulated" if request.param == "ray" else "inline"
    )
    return result


def test_json_has_the_documented_fields(engine_result: dict[str, Any]) -> None:
    simulated = engine_result
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
def test_engines_are_recorded(simulated: dict[str, Any], inline: dict[str, Any]) -> None:
    assert simulated["config"]["engine"] == "ray"
    assert simulated["config"]["num-cpus-per-client"] == 1.0
    assert inline["config"]["engine"] == "inline"
    assert "num-cpus-per-client" not in inline["config"]  # no Ray resources inline


@pytest.mark.slow
def test_ray_run_matches_the_inline_run_exactly(
    simulated: dict[str, Any], inline: dict[str, Any]
) -> None:
    for ray_round, inline_round in zip(simulated["rounds"], inline["rounds"], strict=True):
        assert ray_round["accuracy"] == inline_round["accuracy"]
        assert ray_round["loss"] == inline_round["loss"]
        assert ray_round["bytes_up"] == inline_round["bytes_up"]
        assert ray_round["bytes_down"] == inline_round["bytes_down"]
    assert simulated["final_fingerprint"] == inline["final_fingerprint"] is not None


def test_the_inline_engine_runs_the_apps_of_flwr_run() -> None:
    """The Python API's inline engine gives what the ServerApp gives on an InlineGrid."""
    from clients.client_app import make_client_app
    from fedddl.flower.inline_grid import InlineGrid
    from fedddl.flower.simulation import run
    from strategies.server_app import run_server

    cfg = AppConfig(num_server_rounds=2, seed=3, min_available_nodes=2)
    result = run(cfg, num_clients=2, engine="inline", progress=None)
    local = run_server(InlineGrid(make_client_app(cfg), 2), cfg, progress=lambda _: None)
    assert [r["bytes_up"] for r in result["rounds"]] == [r["bytes_up"] for r in local["rounds"]]
    assert result["final_fingerprint"] == local["final_fingerprint"] is not None
    with pytest.raises(ValueError, match="engine must be one of ray, inline"):
        run(cfg, num_clients=2, engine="dask")


def test_bad_arguments_exit_2_without_running() -> None:
    assert main(["simulate", "--downlink", "reternarize", "--fraction-train", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["simulate", "--engine", "dask"])  # argparse: not one of the choices


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


def test_a_stratified_split_finer_than_a_class_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # digits' training split has 131 samples of its rarest class (8)
    args = ["simulate", "--engine", "inline", "--num-clients", "132", "--rounds", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "digits training set (1347 samples) over 132 clients" in err
    assert "131 samples of class 8" in err and 'partition = "random"' in err
    from fedddl.flower.simulation import run
    from fedddl.partition import PartitionError

    with pytest.raises(PartitionError, match="over 1000 clients"):
        run(AppConfig(num_server_rounds=1), num_clients=1000, engine="ray")
