"""Tests of the ``fedddl gossip`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedddl.cli import main


def test_writes_result_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r" / "gossip.json"
    argv = [
        "gossip", "--scheduler", "random", "--network", "heterogeneous", "--nodes", "4",
        "--dataset", "digits", "--partition", "random", "--target-accuracy", "1.0",
        "--max-virtual-time", "2", "--seed", "1", "--lr", "0.2", "--batch-size", "16",
        "--compute-time-s", "0.1", "--eval-interval-s", "0.5", "--out", str(out),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    expected = {
        "config", "curve", "time_to_target_s", "bytes_total", "messages", "stale_merges",
        "final_accuracy",
    }
    assert expected <= set(result)
    assert result["config"]["scheduler"] == "random" and result["config"]["lr"] == 0.2
    assert result["config"]["batch_size"] == 16 and result["config"]["partition"] == "random"
    assert result["time_to_target_s"] is None  # 100 % is out of reach in 2 s
    assert [t for t, _ in result["curve"]] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert all(0.0 <= a <= 1.0 for _, a in result["curve"])
    assert isinstance(result["bytes_total"], int) and isinstance(result["messages"], int)
    assert result["bytes_total"] == result["messages"] * result["model_bytes"]
    # 4 nodes x (2 s / 0.1 s) = 80 steps at most
    assert 0 < sum(result["steps_per_node"]) <= 80
    err = capsys.readouterr().err
    assert "t=    1.00s" in err and "wrote" in err


def test_reports_time_to_target(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    argv = [
        "gossip", "--nodes", "4", "--target-accuracy", "0.5", "--max-virtual-time", "3",
        "--out", str(out), "--quiet", "--stop-at-target",
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    reached = result["time_to_target_s"]
    assert reached is not None and reached == result["curve"][-1][0]
    assert result["curve"][-1][1] >= 0.5 > result["curve"][-2][1]


def test_bad_network_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gossip", "--network", "mars.json", "--nodes", "4", "--quiet"]) == 2
    assert "neither a profile" in capsys.readouterr().err


def test_bad_compute_time_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["gossip", "--compute-time-s", "fast"])
    assert "--compute-time-s" in capsys.readouterr().err


def test_compressor_option_sends_compressed_differences(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    argv = ["gossip", "--nodes", "4", "--max-virtual-time", "1", "--compressor", "ternary-base3",
            "--consensus-step", "0.3", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["compressor"] == "ternary-base3"
    assert result["config"]["consensus_step"] == 0.3
    assert 0 < result["message_bytes_mean"] < result["model_bytes"] / 12


def test_unknown_compressor_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gossip", "--nodes", "4", "--compressor", "zip"]) == 2
    assert "unknown compressor 'zip'" in capsys.readouterr().err


def test_stops_at_target_unless_told_to_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["gossip", "--nodes", "4", "--target-accuracy", "0.5", "--max-virtual-time", "3",
            "--quiet"]  # fmt: skip
    stopped, continued = tmp_path / "stop.json", tmp_path / "go-on.json"
    assert main([*base, "--out", str(stopped)]) == 0
    first = capsys.readouterr().err
    assert main([*base, "--continue-after-target", "--out", str(continued)]) == 0
    second = capsys.readouterr().err
    stop, go_on = json.loads(stopped.read_text()), json.loads(continued.read_text())
    reached = stop["time_to_target_s"]
    assert reached is not None and reached == go_on["time_to_target_s"]
    assert stop["curve"][-1][0] == reached < 3.0  # ended at the evaluation that reached it
    assert go_on["curve"][-1][0] == 3.0
    assert f"reached at virtual t = {reached:.2f} s (run stopped there)" in first
    assert f"reached at virtual t = {reached:.2f} s, ran on to 3.00 s" in second
