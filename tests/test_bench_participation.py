"""``simulations/bench_participation.py`` runs and prints one row per strategy (a short run)."""

from __future__ import annotations

import pytest

from simulations import bench_participation


def test_a_short_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--rounds", "7", "--clients", "6", "--fractions", "0.5", "--only", "grid"]
    assert bench_participation.main(argv) == 0
    out = capsys.readouterr().out
    rows = {
        line[10:50].strip(): line[50:].split()
        for line in out.splitlines()
        if line.strip().startswith("0.50")
    }
    grids = {"TernGrad (grid, L=1)", "TernaryDelta+FedAvg (grid, L=1)",
             "TernaryDelta+FedAvg (grid, L=1, all mod)"}  # fmt: skip
    assert set(rows) == grids | {"FedAvg"}
    assert float(rows["FedAvg"][2]) == 1.0 and float(rows["FedAvg"][3]) == 1.0
    for label in grids:
        assert float(rows[label][3]) < 0.5, label  # bytes down against FedAvg's


def test_rounds_must_exceed_the_skipped_ones() -> None:
    with pytest.raises(SystemExit):
        bench_participation.main(["--rounds", "5"])
