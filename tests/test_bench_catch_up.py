"""``simulations/bench_catch_up.py`` runs and prints one row per K (a short run; the script
itself checks every catch-up bit for bit against the server's state)."""

from __future__ import annotations

import pytest

from simulations import bench_catch_up


def test_a_short_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_catch_up.main(["--rounds", "12", "--from-round", "11", "--behind", "1,2,5"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.strip()[:2].strip().isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2, 5]
    grid = [int(row[1].split()[0].replace(",", "")) for row in rows]
    base3 = [int(row[2].split()[0].replace(",", "")) for row in rows]
    assert all(g < b for g, b in zip(grid[1:], base3[1:], strict=True))  # K >= 2: the grid wins
    assert "test accuracy" in out


def test_from_round_must_leave_room_for_every_k() -> None:
    with pytest.raises(SystemExit):
        bench_catch_up.main(["--rounds", "12", "--from-round", "5", "--behind", "1,5"])
