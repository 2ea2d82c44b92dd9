"""simulations/sweep_settings.py: its parsing and one tiny sweep end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations import sweep_settings


def test_settings_parse_into_typed_run_config_values() -> None:
    sweep = sweep_settings
    label, keys = sweep.parse_setting("ts: strategy='terngrad' error-feedback=true x=0.5")
    assert label == "ts"
    assert keys == {"strategy": "terngrad", "error-feedback": True, "x": 0.5}
    with pytest.raises(ValueError, match="label"):
        sweep.parse_setting("no label strategy='terngrad'")
    with pytest.raises(ValueError, match="key=value"):
        sweep.parse_keys("strategy")
    with pytest.raises(ValueError, match="strategy"):
        sweep.parse_keys("strategy=terngrad")  # an unquoted string, as Flower says


def test_a_tiny_sweep_prints_the_table_and_writes_every_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = sweep_settings
    out = tmp_path / "runs.json"
    code = sweep.main([
        "--base", "num-server-rounds=2 eval-every=1 eval-samples=50",
        "--setting", "ga: strategy='gradient-average'",
        "--setting", "tg: strategy='terngrad'",
        "--seeds", "0", "--num-clients", "2", "--jobs", "1", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "final - ga: +0.0000" in text and "tg " in text
    runs = json.loads(out.read_text())["runs"]
    assert [(r["label"], len(r["curve"])) for r in runs] == [("ga", 2), ("tg", 2)]
    assert runs[1]["bytes_up"] < runs[0]["bytes_up"]  # ternary against fp32
    with pytest.raises(SystemExit):
        sweep.main(["--setting", "a: strategy='terngrad'", "--setting", "a: strategy='fedavg'"])


def test_saved_runs_print_as_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(label: str, seed: int, accuracy: float) -> dict[str, object]:
        curve = [[1, accuracy - 0.1], [2, accuracy]]
        return {"label": label, "seed": seed, "curve": curve, "final_accuracy": accuracy,
                "bytes_up": 10.0, "bytes_down": 20.0, "seconds": 1.0}  # fmt: skip

    (tmp_path / "a.json").write_text(json.dumps({"base": {}, "runs": [run("ga", 0, 0.9)]}))
    (tmp_path / "b.json").write_text(
        json.dumps({"base": {}, "runs": [run("tg", 0, 0.8), run("ga", 1, 0.7)]})
    )
    files = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert sweep_settings.main(["--tables", *files]) == 0
    text = capsys.readouterr().out
    assert "seeds [0, 1]" in text
    assert "r2 0.8000 [0.7000, 0.9000]" in text  # ga over both files
    assert "final - ga: -0.1000" in text  # tg against ga, seed 0
    assert sweep_settings.main(["--tables", *files, "--labels", "tg,ga"]) == 0
    assert "final - tg: +0.1000" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no runs labelled x"):
        sweep_settings.main(["--tables", *files, "--labels", "x"])
