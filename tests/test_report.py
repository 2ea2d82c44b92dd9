"""Report statistics, tables, manifest checks and ``fedddl report`` on a real quick run."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedddl.cli import main as cli_main
from fedddl.report.manifest import ManifestError, load_manifest, write_manifest
from fedddl.report.stats import (
    Link,
    aggregate_rounds,
    band_on_grid,
    first_reach,
    mean_std,
    round_series,
    simulated_round_times,
    transfer_time,
)
from fedddl.report.tables import Table, fmt_reach, markdown_table
from simulations import run_experiments

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_driver(argv: list[str]) -> int:
    """Run the experiment driver (``python -m simulations.run_experiments``) in-process."""
    return int(run_experiments.main(argv))


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (also checks the signature)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def _rounds(acc: list[float], up: int, down: int, wall: float) -> dict[str, Any]:
    return {"rounds": [{"round": i + 1, "accuracy": a, "loss": 1.0 - a, "bytes_up": up,
                        "bytes_down": down, "replicas_equal": True, "wall_s": wall}
                       for i, a in enumerate(acc)]}


def test_first_reach_and_mean_std() -> None:
    assert first_reach([1, 2, 3, 4], [0.1, 0.5, 0.91, 0.95], 0.9) == 3.0
    assert first_reach([1, 2], [0.1, 0.5], 0.9) is None
    assert first_reach([5.0, 7.5], [0.9, 0.2], 0.9) == 5.0  # equality counts as reached
    mean, std, present, total = mean_std([2.0, None, 4.0])
    assert (mean, std, present, total) == (3.0, 1.0, 2, 3)
    assert math.isnan(mean_std([None])[0])


def test_simulated_round_time_is_compute_plus_both_transfers() -> None:
    link = Link("10 MB/s", bandwidth_Bps=1e7, latency_s=0.01)
    series = round_series(_rounds([0.2, 0.4, 0.6], up=2_000_000, down=5_000_000, wall=0.5))
    times = simulated_round_times(series, link)
    per_round = 0.5 + (0.01 + 0.2) + (0.01 + 0.5)
    np.testing.assert_allclose(times, per_round * np.arange(1, 4))
    assert transfer_time(1e7, link) == pytest.approx(1.01)
    # A round that moved nothing costs only its compute time.
    zero = round_series(_rounds([0.1], up=0, down=0, wall=0.25))
    np.testing.assert_allclose(simulated_round_times(zero, link), [0.25])
    # One stalled round (another job on the machine) does not change the compute term.
    stalled = _rounds([0.2, 0.4, 0.6, 0.7, 0.8], up=0, down=0, wall=0.5)
    stalled["rounds"][2]["wall_s"] = 30.0
    np.testing.assert_allclose(simulated_round_times(round_series(stalled), link),
                               0.5 * np.arange(1, 6))
    np.testing.assert_allclose(series["cum_bytes"], [7e6, 14e6, 21e6])


def test_round_series_adds_initial_round_and_drops_actor_start_up() -> None:
    result = _rounds([0.3, 0.5, 0.6, 0.7], up=10, down=20, wall=0.4)
    result["rounds"][0]["wall_s"] = 90.0  # Ray actors starting in round 1
    result["rounds"][2]["wall_s"] = 0.6
    result["initial"] = {"accuracy": 0.1, "loss": 2.3}
    series = round_series(result)
    np.testing.assert_allclose(series["round"], [0, 1, 2, 3, 4])
    np.testing.assert_allclose(series["accuracy"], [0.1, 0.3, 0.5, 0.6, 0.7])
    np.testing.assert_allclose(series["wall_s"], [0.0, 0.4, 0.4, 0.6, 0.4])  # median of later
    np.testing.assert_allclose(series["wall_s_raw"], [0.0, 90.0, 0.4, 0.6, 0.4])
    np.testing.assert_allclose(series["cum_bytes"], [0, 30, 60, 90, 120])


def test_round_series_rejects_missing_fields() -> None:
    with pytest.raises(ValueError, match="no rounds"):
        round_series({"rounds": []})
    with pytest.raises(ValueError, match="wall_s"):
        round_series({"rounds": [{"round": 1, "accuracy": 0.5, "loss": 1, "bytes_up": 1,
                                  "bytes_down": 1}]})
    row = {"round": 1, "accuracy": 0.5, "loss": None, "bytes_up": 1, "bytes_down": 1,
           "wall_s": 0.1}
    assert np.isnan(round_series({"rounds": [row]})["loss"][0])  # a diverged model's loss
    with pytest.raises(ValueError, match="no evaluated round"):
        round_series({"rounds": [{**row, "accuracy": None}]})
    # eval-every = 2: curves at rounds 2 and 4, bytes of rounds 1-4 counted.
    every_other = round_series({"rounds": [
        {**row, "round": n, "accuracy": None if n % 2 else n / 10, "bytes_up": 10 * n}
        for n in (1, 2, 3, 4)]})
    np.testing.assert_array_equal(every_other["round"], [2, 4])
    np.testing.assert_array_equal(every_other["accuracy"], [0.2, 0.4])
    np.testing.assert_array_equal(every_other["cum_bytes"], [10 + 20 + 2, 100 + 4])
    link = Link("l", 1000.0, 0.0)
    every = round_series({"rounds": [{**row, "round": n, "accuracy": n / 10}
                                     for n in (1, 2, 3, 4)]})
    sparse = round_series({"rounds": [{**row, "round": n, "accuracy": None if n % 2 else n / 10}
                                      for n in (1, 2, 3, 4)]})
    np.testing.assert_allclose(simulated_round_times(sparse, link),
                               simulated_round_times(every, link)[[1, 3]])


def test_aggregate_rounds_truncates_to_shortest_run() -> None:
    band = aggregate_rounds([np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0])],
                            [np.array([0.2, 0.4, 0.9]), np.array([0.4, 0.6])])
    np.testing.assert_allclose(band.x, [1.0, 2.0])
    np.testing.assert_allclose(band.mean, [0.3, 0.5])
    np.testing.assert_allclose(band.low, [0.2, 0.4])
    np.testing.assert_allclose(band.high, [0.4, 0.6])
    assert band.num_seeds == 2


def test_band_on_grid_steps_and_never_extrapolates() -> None:
    a = [[0.0, 0.1], [1.0, 0.5], [2.0, 0.7], [3.0, 0.8]]
    b = [[0.5, 0.2], [2.5, 0.6]]
    band = band_on_grid([a, b], num_points=5)
    np.testing.assert_allclose(band.x, [0.5, 1.0, 1.5, 2.0, 2.5])
    # a as a step function at the grid: 0.1, 0.5, 0.5, 0.7, 0.7; b: 0.2, 0.2, 0.2, 0.2, 0.6
    np.testing.assert_allclose(band.mean, [0.15, 0.35, 0.35, 0.45, 0.65])
    with pytest.raises(ValueError):
        band_on_grid([[]])


def test_markdown_table_and_reach_format() -> None:
    table = Table("t", ["a", "b"])
    table.add(["x|y", "1"], {"a": "x|y"})
    with pytest.raises(ValueError, match="2 columns"):
        table.add(["only one"], {})
    text = markdown_table(table)
    assert text.splitlines() == ["| a | b |", "| --- | --- |", "| x\\|y | 1 |"]
    assert fmt_reach(float("nan"), float("nan"), 0, 3) == "not reached (0/3)"
    assert fmt_reach(12.0, 1.5, 2, 3) == "12.0 ± 1.5 (2/3)"


def test_manifest_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="does not exist"):
        load_manifest(tmp_path / "nope")
    with pytest.raises(ManifestError, match="missing result file"):
        load_manifest(tmp_path)
    write_manifest(tmp_path, {"experiments": {"x": {"tool": "teleport", "target_accuracy": 0.9,
                                                    "variants": []}}})
    with pytest.raises(ManifestError, match="unknown tool"):
        load_manifest(tmp_path)
    assert cli_main(["report", str(tmp_path / "nope")]) == 1


@pytest.fixture(scope="module")
def gossip_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real quick gossip suite (2 seeds) run through the driver, without its report."""
    out = tmp_path_factory.mktemp("gossip_results")
    assert run_driver(["--experiment", "gossip", "--quick", "--seeds", "0", "1",
                       "--out", str(out), "--no-report"]) == 0
    return out


def test_report_command_on_real_gossip_runs(gossip_results: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert not (gossip_results / "report.md").exists()
    assert cli_main(["report", str(gossip_results)]) == 0
    printed = capsys.readouterr().out
    manifest = json.loads((gossip_results / "manifest.json").read_text())
    variants = manifest["experiments"]["gossip"]["variants"]
    report = (gossip_results / "report.md").read_text()
    for v in variants:  # one table row per configuration, printed and written
        row = f"| {v['group']} | {v['label']} | 2 |"
        assert row in printed and row in report
    width, height = png_size(gossip_results / "gossip_accuracy.png")
    assert width > 300 and height > 150
    csv_lines = (gossip_results / "summary.csv").read_text().strip().splitlines()
    assert len(csv_lines) == 1 + len(variants)


def test_report_rejects_accuracy_outside_unit_interval(gossip_results: Path,
                                                       tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(gossip_results, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    first = manifest["experiments"]["gossip"]["variants"][0]["runs"][0]["result"]
    data = json.loads((broken / first).read_text())
    data["curve"][0][1] = 1.5
    (broken / first).write_text(json.dumps(data))
    assert cli_main(["report", str(broken)]) == 1


def test_outcome_points_compare_each_run_with_stratified_of_its_group_and_seed(
    tmp_path: Path,
) -> None:
    from fedddl.report.build import outcome_points
    from fedddl.report.plots import plot_bands, plot_outcome_vs_shards
    from fedddl.report.tables import write_csv

    table = Table("t", ["c"])
    for group, offset in (("g1", 0.0), ("g2", 0.5)):
        for label, acc, kl in (("stratified", 0.8, 1e-4), ("random", 0.7, 1e-2)):
            table.add([f"{group}: {label}"], {
                "configuration": f"{group}: {label}", "group": group, "variant": label,
                "final_accuracy_by_seed": {0: acc - offset / 10, 1: acc + 0.01},
                "shard_summary_by_seed": {0: {"kl_divergence_mean": kl},
                                          1: {"kl_divergence_mean": 2 * kl}}})
    table.add(["g3: random"], {"configuration": "g3: random", "group": "g3",
                               "variant": "random", "final_accuracy_by_seed": {0: 0.1},
                               "shard_summary_by_seed": {0: {"kl_divergence_mean": 0.3}}})
    points = outcome_points(table)
    gaps = {(p["group"], p["label"], p["seed"]): p["gap"] for p in points}
    assert gaps == pytest.approx({  # g3 has no stratified run: left out
        ("g1", "stratified", 0): 0.0, ("g1", "stratified", 1): 0.0,
        ("g1", "random", 0): -0.1, ("g1", "random", 1): -0.1,
        ("g2", "stratified", 0): 0.0, ("g2", "stratified", 1): 0.0,
        ("g2", "random", 0): -0.1, ("g2", "random", 1): -0.1})
    assert {p["kl_divergence_mean"] for p in points if p["label"] == "random"} == {1e-2, 2e-2}
    # The nested per-seed values stay out of the CSV.
    csv_text = write_csv([("e", table)], tmp_path / "s.csv").read_text()
    assert "by_seed" not in csv_text
    assert csv_text.splitlines()[0] == "experiment,configuration,group,variant"
    png = plot_outcome_vs_shards(points, tmp_path / "o.png", suptitle="t",
                                 stats=[("kl_divergence_mean", "KL")], outcome="gap",
                                 outcome_label="gap")
    assert png_size(png)[0] > 200
    band = aggregate_rounds([np.arange(1, 4)], [np.array([0.1, 0.2, 0.3])])
    wide = plot_bands([(f"p{i}", "round", {"a": band}) for i in range(5)], tmp_path / "g.png",
                      suptitle="s", columns=2)
    width, height = png_size(wide)
    assert height > width  # 3 rows of 2 panels, not one row of 5
