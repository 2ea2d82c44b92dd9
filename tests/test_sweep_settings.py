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
