"""``simulations/bench_scale.py`` runs its smallest configuration and prints its row."""

from __future__ import annotations

import pytest

from simulations import bench_scale


def test_the_smallest_configuration_prints_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_scale.main(["--rounds", "2", "--configs", "100:0.05"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in rows if r and r[0] == "100"]
    assert len(rows) == 1
    _, fraction, replies, trained, known, per_round, down, rss, _ = rows[0]
    assert float(fraction) == 0.05 and float(replies) == 5.0
    # 2 rounds of 5 sampled clients: at most 10 of the 100 ever hold state or are known
    assert 5 <= int(trained) <= 10 and int(known) == int(trained)
    assert float(per_round) > 0 and float(down) > 0 and float(rss) > 0


def test_rounds_must_be_at_least_two() -> None:
    with pytest.raises(SystemExit):
        bench_scale.main(["--rounds", "1"])
