"""``simulations.dropin_seed_summary``: paired differences to plain, mean and SE over seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations.dropin_seed_summary import differences, load, summary_lines


def _run(variant: str, seed: int, accuracies: list[float]) -> dict[str, object]:
    return {"strategy": "fedavg", "epochs": 1, "seed": seed, "variant": variant,
            "rounds": [{"round": r, "accuracy": a} for r, a in enumerate(accuracies)]}


def test_pairs_each_seed_with_its_plain_run_and_averages_windows(tmp_path: Path) -> None:
    plain = [_run("plain", s, [0.1] * 16) for s in (0, 1)]
    dropin = [_run("dropin", 0, [0.1] * 4 + [0.08, 0.07, 0.09] + [0.1] * 9),
              _run("dropin", 1, [0.1] * 4 + [0.10, 0.09, 0.11] + [0.1] * 9)]
    stray = _run("dropin", 0, [0.5] * 16)
    settings = {"clients": 10, "fraction": 0.5, "samples": 1000, "test_samples": 2000, "lr": 0.01}
    (tmp_path / "a.json").write_text(json.dumps({"args": settings, "results": [*plain, stray]}))
    (tmp_path / "b.json").write_text(json.dumps({"args": settings, "results": dropin}))
    other = {**settings, "samples": 500}  # a plain run of other settings is never paired
    (tmp_path / "c.json").write_text(json.dumps(
        {"args": other, "results": [_run("plain", 1, [0.9] * 16)]}))
    runs = load([f"plain:{tmp_path / 'a.json'}", str(tmp_path / "b.json"),
                 f"plain:{tmp_path / 'c.json'}"])
    assert len(runs) == 5  # the plain: file's dropin run is left out
    diffs = differences(runs)
    group = ("fedavg", 1, "dropin", tuple(settings.values()))
    assert diffs[group][0][5] == pytest.approx(-0.03)
    (line,) = summary_lines(diffs)
    # round 5: -3 and -1 points; rounds 4-6: -2 and 0; no round 50 in 16 rounds
    assert line.startswith("fedavg E1 dropin seeds=[0, 1]: r5 -2.00±1.00 r4-6 -1.00±1.00 r15 +0.00")
    assert "r50" not in line


def test_runs_of_other_settings_are_summed_up_apart(tmp_path: Path) -> None:
    settings = {"clients": 10, "fraction": 0.5, "samples": 1000, "test_samples": 2000, "lr": 0.01}
    full = {**settings, "fraction": 1.0}
    for name, args, drop in (("a", settings, 0.08), ("b", settings, 0.09), ("c", full, 0.11)):
        runs = [_run("plain", 0, [0.1] * 6), _run("dropin", 0, [0.1] * 5 + [drop])]
        if name == "b":  # a second seed of the usual settings
            runs = [{**r, "seed": 1} for r in runs]
        (tmp_path / f"{name}.json").write_text(json.dumps({"args": args, "results": runs}))
    lines = summary_lines(differences(load([str(tmp_path / f"{n}.json") for n in "abc"])))
    assert len(lines) == 2
    usual = next(line for line in lines if "fraction" not in line)
    other = next(line for line in lines if "[fraction=1.0]" in line)
    assert usual.startswith("fedavg E1 dropin seeds=[0, 1]: r5 -1.50±0.50")
    assert other.startswith("fedavg E1 dropin [fraction=1.0] seeds=[0]: r5 +1.00±0.00")
