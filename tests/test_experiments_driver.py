"""The experiment driver: TOML resolution and a real quick run of every experiment."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from simulations import compressed_gossip_summary, experiment_spec, run_experiments, tool_runners

SEEDS = (0, 1)  # the test uses 2 seeds for speed; the committed results use >= 3


def test_every_experiment_resolves_for_every_dataset() -> None:
    driver = run_experiments
    spec_mod = experiment_spec
    for name in driver.EXPERIMENTS:
        full = spec_mod.load_experiment(name)
        quick = spec_mod.load_experiment(name, quick=True)
        fmnist = spec_mod.load_experiment(name, dataset="fashion-mnist", data_root="/data")
        assert len(full.variants) >= 3
        assert list(dict.fromkeys(v.label for v in quick.variants)) == list(
            dict.fromkeys(v.label for v in full.variants))
        for variant in fmnist.variants:
            assert variant.config["dataset"] == "fashion-mnist"
            assert variant.config["data-root"] == "/data"
        if full.tool == "simulate":
            # [quick] shrinks the run; each variant's defining key survives every override.
            assert quick.variants[0].config["num-server-rounds"] < full.variants[0].config[
                "num-server-rounds"]
            assert "target-accuracy" not in full.variants[0].config
        assert fmnist.target_accuracy < full.target_accuracy  # harder data, lower bar
    ternary = spec_mod.load_experiment("ternary", quick=True)
    assert [v.config["strategy"] for v in ternary.variants] == [
        "terngrad", "gradient-average", "fedavg"]
    assert {link["name"] for link in ternary.links} == {"10 Mbit/s", "100 Mbit/s", "1 Gbit/s"}
    with pytest.raises(ValueError, match="no experiment 'nope'"):
        spec_mod.load_experiment("nope")


def test_print_commands_lists_one_line_per_run(capsys: pytest.CaptureFixture[str]) -> None:
    driver = run_experiments
    assert driver.main(["--experiment", "sharding", "--seeds", "0", "1", "--print-commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5 * 2
    assert all(line.startswith("fedddl simulate ") for line in lines)
    assert "--partition dirichlet" in lines[4] and "--seed 0" in lines[4]
    assert "--fraction-train 1.0" in lines[-1] and "--seed 1" in lines[-1]


def test_printed_commands_parse_and_mean_the_same_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every printed line is a valid ``fedddl`` command that runs the driver's config."""
    import shlex

    from fedddl.app_config import AppConfig
    from fedddl.cli import build_parser

    driver = run_experiments
    assert driver.main(["--experiment", "all", "--seeds", "0", "--print-commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    parser = build_parser()
    for line in lines:
        args = parser.parse_args(shlex.split(line)[1:])
        if args.command == "gossip":  # the driver records whole curves
            assert args.continue_after_target, line
    runners = tool_runners
    line = runners.command_line(
        "simulate", {"strategy": "terngrad", "min-replies": 2, "error-feedback": False,
                     "compressor": "ternary"}, Path("o.json"))  # fmt: skip
    args = parser.parse_args(shlex.split(line)[1:])
    from fedddl.flower.run_config import parse_run_config

    cfg = AppConfig(compressor=args.compressor).updated(parse_run_config(args.run_config))
    assert (cfg.min_replies, cfg.error_feedback, cfg.compressor) == (2, False, "ternary")


def _png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 150 and len(data) > 10_000, path
    assert len(data) <= 150_000, f"{path} is {len(data)} bytes; keep figures small"


def _check_simulate_run(result: dict[str, Any], rounds: int) -> None:
    assert set(result) >= {"config", "rounds", "final_accuracy"}
    assert len(result["rounds"]) >= rounds
    for r in result["rounds"]:
        assert set(r) >= {"round", "accuracy", "loss", "bytes_up", "bytes_down",
                          "replicas_equal", "wall_s"}
        assert 0.0 <= r["accuracy"] <= 1.0 and r["wall_s"] >= 0 and r["bytes_up"] >= 0
    assert 0.0 <= result["final_accuracy"] <= 1.0


def _run_quick_suite(out: Path, *, full: bool) -> Path:
    """Quick runs through the driver into one folder (the manifest accumulates).

    Each Flower simulation pays Ray's start-up (~15-20 s on 2 idle cores), so the
    default test runs one simulation per server experiment (seed 0, one variant
    each) and the whole gossip grid with 2 seeds; ``full`` runs every variant of
    every experiment with 2 seeds (12 simulations, minutes).
    """
    driver = run_experiments
    seeds = [str(s) for s in SEEDS]
    if full:
        assert driver.main(["--experiment", "all", "--quick", "--seeds", *seeds,
                            "--out", str(out)]) == 0
        return out
    assert driver.main(["--experiment", "gossip", "compressed_gossip", "--quick", "--seeds",
                        *seeds, "--out", str(out), "--no-report"]) == 0
    assert driver.main(["--experiment", "sharding", "ternary", "--quick", "--seeds", "0",
                        "--variants", "sharding:stratified", "ternary:terngrad",
                        "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def quick_suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every experiment through the driver in quick mode, then the report."""
    return _run_quick_suite(tmp_path_factory.mktemp("suite"), full=False)


def check_result_files(out: Path) -> None:
    """Every run the manifest lists exists and has the tool's schema with sane values."""
    spec_mod = experiment_spec
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quick"] is True
    ran = {"sharding", "ternary", "gossip", "compressed_gossip"}  # (all of them with "all")
    assert ran <= set(manifest["experiments"]) <= set(run_experiments.EXPERIMENTS)
    for name, exp in manifest["experiments"].items():
        spec = spec_mod.load_experiment(name, quick=True)
        labels = [v.label for v in spec.variants]
        assert exp["variants"] and all(v["label"] in labels for v in exp["variants"])
        if name in ("gossip", "compressed_gossip"):
            assert len(exp["variants"]) == len(labels) and exp["seeds"] == list(SEEDS)
        for variant in exp["variants"]:
            assert [r["seed"] for r in variant["runs"]] == exp["seeds"]
            for run in variant["runs"]:
                result = json.loads((out / run["result"]).read_text())
                if exp["tool"] == "simulate":
                    _check_simulate_run(result, variant["config"]["num-server-rounds"])
                    assert result["config"]["strategy"] == variant["config"]["strategy"]
                    assert result["config"]["seed"] == run["seed"]
                else:
                    assert result["curve"], "gossip curve is empty"
                    assert all(0.0 <= acc <= 1.0 for _, acc in result["curve"])
                    assert result["bytes_total"] > 0 and result["messages"] > 0
                    compressor = variant["config"].get("compressor", "")
                    assert result["compressor"] == (compressor or None)
                if spec.shard_statistics:
                    shards = json.loads((out / run["shards"]).read_text())
                    assert len(shards["shards"]) == variant["config"]["num-clients"]
                    assert shards["summary"]["disjoint"] and shards["summary"]["covers_all"]


def check_report(out: Path) -> None:
    """PNGs are valid and small, and report.md has one table row per configuration."""
    report = (out / "report.md").read_text()
    for png in ("sharding_accuracy", "sharding_shards", "ternary_accuracy", "gossip_accuracy",
                "compressed_gossip_accuracy"):
        _png_ok(out / f"{png}.png")
        assert f"]({png}.png)" in report
    manifest = json.loads((out / "manifest.json").read_text())
    sections = {part.split("\n", 1)[0]: part for part in report.split("\n## ")[1:]}
    for exp in manifest["experiments"].values():
        # Rows of this experiment's own section: two gossip experiments share labels.
        rows = [line for line in sections[exp["title"]].splitlines() if line.startswith("| ")]
        for v in exp["variants"]:
            cells = ([v["group"], v["label"]] if exp["tool"] == "gossip" else
                     [f"{v['group']}: {v['label']}" if v["group"] else v["label"]])
            prefix = "| " + " | ".join(cells) + f" | {len(exp['seeds'])} |"
            assert sum(row.startswith(prefix) for row in rows) == 1, prefix
    assert "100 Mbit/s" in report and "quick mode" in report
    csv_rows = (out / "summary.csv").read_text().strip().splitlines()[1:]
    assert len(csv_rows) == sum(len(e["variants"]) for e in manifest["experiments"].values())


@pytest.mark.slow
def test_quick_suite_writes_every_result_file(quick_suite: Path) -> None:
    check_result_files(quick_suite)


@pytest.mark.slow
def test_quick_suite_report_has_plots_and_a_row_per_configuration(quick_suite: Path) -> None:
    check_report(quick_suite)


def test_stratified_shards_match_the_global_class_mix_better_than_random() -> None:
    runners = tool_runners
    config = {"dataset": "digits", "num-clients": 10, "seed": 0}
    strat = runners.shard_statistics({**config, "partition": "stratified"})["summary"]
    rand = runners.shard_statistics({**config, "partition": "random"})["summary"]
    assert strat["kl_divergence_mean"] < rand["kl_divergence_mean"] / 5
    assert strat["max_abs_deviation_max"] < rand["max_abs_deviation_max"]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FEDDDL_FULL_SUITE_TEST"),
                    reason="12 Flower simulations (minutes); set FEDDDL_FULL_SUITE_TEST=1")
def test_full_quick_suite_every_variant(tmp_path: Path) -> None:
    out = _run_quick_suite(tmp_path, full=True)
    check_result_files(out)
    check_report(out)


@pytest.mark.slow
def test_compressed_gossip_summary_reads_the_runs(quick_suite: Path) -> None:
    lines = compressed_gossip_summary.summarize(quick_suite)
    manifest = json.loads((quick_suite / "manifest.json").read_text())
    variants = manifest["experiments"]["compressed_gossip"]["variants"]
    assert sum(line.startswith(("homogeneous ", "heterogeneous ")) for line in lines) == len(
        variants)
    ratios = [line for line in lines if "fp32/compressed bytes total" in line]
    assert len(ratios) == 2  # one per network
    # Quick runs are tiny, but every compressed message is still far below fp32.
    assert all(float(line.split("model bytes ")[1].split("x")[0]) > 5 for line in ratios), ratios


def test_variants_are_selected_by_label_or_by_group_and_label() -> None:
    driver = run_experiments
    spec = driver.load_experiment("compressed_gossip", dataset="digits", quick=True)
    one = driver._select(spec, ["heterogeneous/scheduled", "homogeneous/random"])
    assert [(v.group, v.label) for v in one.variants] == [
        ("homogeneous", "random"), ("heterogeneous", "scheduled")]
    both = driver._select(spec, ["scheduled"])
    assert [(v.group, v.label) for v in both.variants] == [
        ("homogeneous", "scheduled"), ("heterogeneous", "scheduled")]
    with pytest.raises(ValueError, match="no variant"):
        driver._select(spec, ["lan/scheduled"])


MATRIX_TOML = """
[experiment]
tool = "simulate"
shard-statistics = true
[config]
strategy = "fedavg"
num-clients = 10
local-steps = 1
num-server-rounds = 9
[matrix]
num-clients = [4, 8]
local-steps = [1, 5]
group = "{num-clients} x {local-steps}"
[quick.matrix]
num-clients = [2]
group = "{num-clients} quick"
[datasets.fashion-mnist]
num-server-rounds = 3
[datasets.fashion-mnist.matrix]
num-clients = [100]
group = "{num-clients} workers"
[[variants]]
label = "a"
partition = "stratified"
[[variants]]
label = "b"
partition = "random"
local-steps = 7
"""


def test_matrix_runs_every_variant_in_every_group(tmp_path: Path) -> None:
    spec_mod = experiment_spec
    (tmp_path / "m.toml").write_text(MATRIX_TOML)
    spec = spec_mod.load_experiment("m", directory=tmp_path)
    assert spec.shard_statistics
    assert [(v.group, v.label) for v in spec.variants] == [
        ("4 x 1", "a"), ("4 x 1", "b"), ("4 x 5", "a"), ("4 x 5", "b"),
        ("8 x 1", "a"), ("8 x 1", "b"), ("8 x 5", "a"), ("8 x 5", "b")]
    configs = {(v.group, v.label): v.config for v in spec.variants}
    assert configs[("8 x 5", "a")]["num-clients"] == 8  # the matrix beats [config]
    assert configs[("8 x 5", "a")]["local-steps"] == 5
    assert configs[("8 x 1", "b")]["local-steps"] == 7  # a variant's own key beats the matrix
    fmnist = spec_mod.load_experiment("m", directory=tmp_path, dataset="fashion-mnist")
    assert [(v.group, v.config["num-clients"], v.config["num-server-rounds"])
            for v in fmnist.variants] == [("100 workers", 100, 3)] * 2
    quick = spec_mod.load_experiment("m", directory=tmp_path, quick=True)
    assert [v.group for v in quick.variants] == ["2 quick"] * 2
    bad = {
        'group = "{num-clients} x {local-steps}"': ('group = "{num-clients}"', "same name"),
        'local-steps = [1, 5]': ("local-steps = 5", "must be a non-empty list"),
        'label = "a"\n': ('label = "a"\ngroup = "g"\n', "has a group"),
    }
    for old, (new, message) in bad.items():
        (tmp_path / "bad.toml").write_text(MATRIX_TOML.replace(old, new, 1))
        with pytest.raises(ValueError, match=message):
            spec_mod.load_experiment("bad", directory=tmp_path)
    (tmp_path / "bad.toml").write_text(MATRIX_TOML.replace(
        'group = "{num-clients} x {local-steps}"\n', "", 1))
    with pytest.raises(ValueError, match="needs a group template"):
        spec_mod.load_experiment("bad", directory=tmp_path)


@pytest.mark.slow
def test_inline_engine_runs_a_matrix_two_at_a_time_and_replays_exactly(tmp_path: Path) -> None:
    """--engine inline --jobs 2: every run lands, in seed order, and equals a serial rerun."""
    driver = run_experiments
    out = tmp_path / "two"
    assert driver.main(["--experiment", "sharding_at_scale", "--quick", "--seeds", "0", "1",
                        "--variants", "sharding_at_scale:stratified", "sharding_at_scale:random",
                        "--engine", "inline", "--jobs", "2", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    variants = manifest["experiments"]["sharding_at_scale"]["variants"]
    groups = sorted({v["group"] for v in variants})
    assert groups == ["3 workers, 1 steps, fraction 1.0", "3 workers, 2 steps, fraction 1.0"]
    assert [v["label"] for v in variants] == ["stratified", "random"] * 2  # the TOML's order
    for variant in variants:
        assert [r["seed"] for r in variant["runs"]] == [0, 1]
        for run in variant["runs"]:
            result = json.loads((out / run["result"]).read_text())
            assert result["config"]["local-steps" if "local-steps" in result["config"]
                                    else "local_steps"] == variant["config"]["local-steps"]
            assert (out / run["shards"]).is_file()
    report = (out / "report.md").read_text()
    _png_ok(out / "sharding_at_scale_outcome_vs_shards.png")
    assert "| 3 workers, 2 steps, fraction 1.0: random | 2 |" in report
    assert "3 workers, 1 steps, fraction 1.0: rounds to target: " in report
    assert "final accuracy - stratified, seed by seed: random " in report  # paired by seed
    overview = [line for line in report.splitlines() if line.startswith("| 3 workers, 2 steps")]
    assert len(overview) == 3  # its overview row (one cell per variant), then one per variant
    assert overview[0].count("/2)") == 2  # stratified and random, each over 2 seeds
    # The inline grid replays exactly: a serial rerun of one run gives the same model.
    again = tmp_path / "one"
    assert driver.main(["--experiment", "sharding_at_scale", "--quick", "--seeds", "1",
                        "--variants", "sharding_at_scale:3 workers, 2 steps, fraction 1.0/random",
                        "--engine", "inline", "--out", str(again), "--no-report"]) == 0
    rel = next(v for v in variants if v["group"].startswith("3 workers, 2")
               and v["label"] == "random")["runs"][1]["result"]
    first, second = (json.loads((d / rel).read_text()) for d in (out, again))
    assert first["final_fingerprint"] == second["final_fingerprint"]
    assert [r["accuracy"] for r in first["rounds"]] == [r["accuracy"] for r in second["rounds"]]
    assert driver.main(["--experiment", "sharding_at_scale", "--jobs", "0"]) == 2


def test_robustness_matrix_runs_real_attackers_and_draws_final_bars(tmp_path: Path) -> None:
    driver = run_experiments
    out = tmp_path / "robust"
    assert driver.main(["--experiment", "robustness", "--quick", "--seeds", "3",
                        "--variants", "robustness:plain mean", "robustness:median",
                        "--engine", "inline", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    variants = manifest["experiments"]["robustness"]["variants"]
    assert [(v["group"], v["label"]) for v in variants] == [
        ("no attack", "plain mean"), ("no attack", "median"),
        ("sign-flip, 1 of 4", "plain mean"), ("sign-flip, 1 of 4", "median")]
    for variant in variants:
        result = json.loads((out / variant["runs"][0]["result"]).read_text())
        attackers = (result.get("attack") or {}).get("node_ids", [])
        assert len(attackers) == (1 if variant["group"].startswith("sign-flip") else 0)
        assert result["config"]["aggregator"] == variant["config"].get("aggregator", "mean")
    _png_ok(out / "robustness_final.png")
    assert "](robustness_final.png)" in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_failing_run_in_a_worker_keeps_the_others_and_is_named(tmp_path: Path) -> None:
    import dataclasses

    driver = run_experiments
    spec = driver.load_experiment("sharding_at_scale", quick=True)
    good, bad = spec.variants[0], spec.variants[1]
    bad = dataclasses.replace(bad, config={**bad.config, "learning-rate": -1.0})
    spec = dataclasses.replace(spec, variants=[good, bad])
    saved: list[list[dict[str, Any]]] = []
    with pytest.raises(driver.RunsFailed, match=r"1 run\(s\).*random seed 0: ValueError"):
        driver._run_spec(spec, [0], tmp_path, resume=False,
                         runner=driver.RUNNERS["simulate-inline"], on_run=saved.append, jobs=2)
    assert [e["label"] for e in saved[-1]] == ["stratified"]  # the good run is recorded
    assert (tmp_path / saved[-1][0]["runs"][0]["result"]).is_file()
