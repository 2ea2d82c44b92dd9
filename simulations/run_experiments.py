"""Run the claim-reproduction experiments over several seeds and build the report.

Usage::

    python -m simulations.run_experiments \\
        --experiment {sharding,sharding_at_scale,ternary,ternary_resnet8,gossip,
                      compressed_gossip,robustness,all} \\
        --seeds 0 1 2 --dataset digits --out results/ [--data-root R] [--quick] [--resume] \\
        [--jobs N] [--engine {ray,inline}]

Each experiment is a TOML file in ``simulations/experiments/`` (see
``experiment_spec.py``). Every (variant, seed) runs in-process through the
same Python APIs as ``fedddl simulate`` / ``fedddl gossip``; its JSON lands in
``OUT/<experiment>/<variant>/seed<S>.json`` and ``OUT/manifest.json`` is
rewritten after every run, so an interrupted suite keeps what it finished
(``--resume`` then skips those runs). Finally ``fedddl.report.build.build_report``
writes ``OUT/report.md``, ``OUT/summary.csv`` and the PNGs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedddl.data.registry import DATASETS
from fedddl.progress import Progress
from fedddl.report.manifest import MANIFEST_NAME, write_manifest
from simulations.experiment_spec import ExperimentSpec, VariantSpec, load_experiment
from simulations.tool_runners import RUNNERS, command_line, shard_statistics, timed_run

__all__ = [
    "EXPERIMENTS", "RunsFailed", "build_parser", "hardware_description", "main", "parse_only",
    "run_suite",
]

EXPERIMENTS: tuple[str, ...] = (
    "sharding", "sharding_at_scale", "ternary", "ternary_resnet8", "gossip", "compressed_gossip",
    "robustness")

Runner = Callable[[dict[str, Any]], dict[str, Any]]


class RunsFailed(RuntimeError):
    """Some runs raised in worker processes; every other run was saved."""


def hardware_description() -> str:
    """CPU model, core count and accelerator of this machine, for the report."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} CPU cores, {gpu}; torch {torch.__version__}"


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in label)


def _variant_dir(spec: ExperimentSpec, variant: VariantSpec) -> str:
    name = f"{variant.group}_{variant.label}" if variant.group else variant.label
    return f"{spec.name}/{_safe(name)}"


def _say(progress: Progress | None, line: str) -> None:
    """One finished (or kept) run: a line, and one step of the bar."""
    if progress is None:
        print(line, flush=True)
    else:
        progress.advance(1, line)


def _run_file(spec: ExperimentSpec, variant: VariantSpec, seed: int) -> str:
    return f"{_variant_dir(spec, variant)}/seed{seed}.json"


def _run_spec(
    spec: ExperimentSpec,
    seeds: Sequence[int],
    out: Path,
    *,
    resume: bool,
    runner: Runner,
    on_run: Callable[[list[dict[str, Any]]], None],
    progress: Progress | None = None,
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """Run every (variant, seed) of ``spec``; ``on_run(entries)`` after each finished run.

    With ``jobs > 1`` that many runs go at a time in worker processes; files and the
    manifest are written here, in the order runs end, so an interrupted suite keeps
    every finished run whatever the order. A run that fails there does not stop the
    others: once they end, :class:`RunsFailed` names every failed run.
    """
    entries = [{"label": v.label, "group": v.group, "config": v.config, "runs": []}
               for v in spec.variants]
    pending: list[tuple[int, int, dict[str, Any]]] = []

    def record(index: int, seed: int, runtime: float, line: str) -> None:
        rel = _run_file(spec, spec.variants[index], seed)
        run: dict[str, Any] = {"seed": seed, "result": rel, "runtime_s": runtime}
        if spec.shard_statistics:
            shards_rel = rel.replace(".json", ".shards.json")
            if not (resume and (out / shards_rel).is_file()):
                config = {**spec.variants[index].config, "seed": seed}
                (out / shards_rel).write_text(json.dumps(shard_statistics(config), indent=1))
            run["shards"] = shards_rel
        runs = entries[index]["runs"]
        runs.append(run)
        runs.sort(key=lambda r: seeds.index(r["seed"]))
        _say(progress, line)
        on_run([e for e in entries if e["runs"]])

    for index, variant in enumerate(spec.variants):
        for seed in seeds:
            rel = _run_file(spec, variant, seed)
            path = out / rel
            if resume and path.is_file():
                runtime = float(json.loads(path.read_text()).get("_runtime_s", 0.0))
                record(index, seed, runtime, f"[{spec.name}] {variant.group} {variant.label} "
                                             f"seed {seed}: kept {rel}")
            else:
                pending.append((index, seed, {**variant.config, "seed": seed}))

    def finish(index: int, seed: int, result: dict[str, Any], runtime: float) -> None:
        rel = _run_file(spec, spec.variants[index], seed)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(json.dumps({**result, "_runtime_s": runtime}, indent=1))
        variant = spec.variants[index]
        record(index, seed, runtime, f"[{spec.name}] {variant.group} {variant.label} seed "
                                     f"{seed}: {runtime:.1f} s -> {rel}")

    if jobs <= 1:
        for index, seed, config in pending:
            finish(index, seed, *timed_run(runner, config))
    elif pending:
        import multiprocessing
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        context = multiprocessing.get_context("spawn")  # no forked torch/Ray state
        failed: list[str] = []
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = {pool.submit(timed_run, runner, config): (index, seed)
                       for index, seed, config in pending}
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                for future in done:
                    index, seed = futures.pop(future)
                    try:
                        result, runtime = future.result()
                    except Exception as exc:  # keep the other runs; report this one below
                        variant = spec.variants[index]
                        failed.append(f"{variant.group} {variant.label} seed {seed}: "
                                      f"{type(exc).__name__}: {exc}".strip())
                        _say(progress, f"[{spec.name}] FAILED {failed[-1]}")
                        continue
                    finish(index, seed, result, runtime)
        if failed:
            raise RunsFailed(f"{len(failed)} run(s) of {spec.name} failed (the others are "
                               "saved; --resume reruns only these): " + "; ".join(failed))
    return [e for e in entries if e["runs"]]


def _previous_experiments(out: Path, dataset: str, quick: bool) -> dict[str, Any]:
    """Experiments already in ``out/manifest.json`` for the same dataset and mode.

    Running one experiment at a time into the same folder then accumulates
    them, so the report covers all; a different dataset or mode starts afresh.
    """
    path = out / MANIFEST_NAME
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    if old.get("dataset") != dataset or bool(old.get("quick")) != quick:
        return {}
    return dict(old.get("experiments", {}))


def _select(spec: ExperimentSpec, labels: list[str] | None) -> ExperimentSpec:
    """``spec`` restricted to the variants named in ``labels`` (all when None).

    A name is a variant's ``LABEL`` (that label in every group) or ``GROUP/LABEL``
    (that label in one group only, e.g. ``heterogeneous/scheduled``).
    """
    if labels is None:
        return spec

    def names(variant: VariantSpec) -> set[str]:
        return {variant.label, f"{variant.group}/{variant.label}"} if variant.group else {
            variant.label}

    known = set().union(*(names(v) for v in spec.variants))
    unknown = sorted(set(labels) - known)
    if unknown:
        raise ValueError(f"experiment {spec.name!r} has no variant {unknown}; "
                         f"known: {sorted(known)}")
    return dataclasses.replace(spec, variants=[v for v in spec.variants if names(v) & set(labels)])


def parse_only(items: Sequence[str]) -> dict[str, list[str]]:
    """``["sharding:stratified", ...]`` -> ``{"sharding": ["stratified"], ...}``."""
    only: dict[str, list[str]] = {}
    for item in items:
        name, sep, label = item.partition(":")
        if not sep or name not in EXPERIMENTS or not label:
            raise ValueError(f"--variants takes EXPERIMENT:LABEL, got {item!r}")
        only.setdefault(name, []).append(label)
    return only


def run_suite(
    experiments: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    *,
    dataset: str = "digits",
    data_root: str | None = None,
    quick: bool = False,
    resume: bool = False,
    report: bool = True,
    command: str = "",
    only: dict[str, list[str]] | None = None,
    progress: Progress | None = None,
    jobs: int = 1,
    engine: str = "ray",
) -> dict[str, Any]:
    """Run ``experiments`` for every seed, write the manifest, and (optionally) the report.

    Parameters
    ----------
    experiments : sequence of str
        Names of TOML files in ``simulations/experiments``.
    seeds : sequence of int
        Seeds; each configuration runs once per seed.
    out : Path
        Results folder.
    dataset, data_root : str
        Dataset for every run, and its data directory.
    quick : bool
        Tiny configurations (the ``[quick]`` tables), for tests.
    resume : bool
        Keep run files that already exist instead of re-running them.
    report : bool
        Build ``report.md`` / PNGs at the end.
    command : str
        The command line, recorded in the manifest.
    only : dict, optional
        Experiment name -> variant labels to run (others of that experiment are
        skipped); experiments not named run every variant.
    progress : Progress, optional
        Advanced by one per run (a bar with time left on a terminal); without it each
        run prints one line to stdout.
    jobs : int
        Runs at a time (worker processes, one torch thread each).
    engine : str
        ``"ray"``: Flower's simulation engine, as ``fedddl simulate``; ``"inline"``: the
        same ServerApp and ClientApp in one process without Ray (replies in a fixed
        order; no Ray start per run). Gossip runs are the same under both.

    Returns
    -------
    dict
        The manifest written to ``out/manifest.json``.
    """
    specs = [_select(load_experiment(n, dataset=dataset, quick=quick, data_root=data_root),
                     (only or {}).get(n))
             for n in experiments]  # parse everything first: fail before hours of runs
    manifest: dict[str, Any] = {
        "dataset": dataset, "seeds": list(seeds), "quick": quick,
        "hardware": hardware_description(), "command": command,
        "experiments": _previous_experiments(out, dataset, quick),
    }
    for spec in specs:
        exp: dict[str, Any] = {
            "tool": spec.tool, "title": spec.title, "claim": spec.claim,
            "target_accuracy": spec.target_accuracy, "links": spec.links,
            "source": str(spec.source.name) if spec.source else "", "variants": [],
            "seeds": list(seeds), "command": command,
        }
        previous = manifest["experiments"].get(spec.name, {})
        manifest["experiments"][spec.name] = exp
        rerun = {(v.group, v.label) for v in spec.variants}
        # A --variants run adds to (or replaces) variants recorded earlier in this folder.
        kept = [v for v in previous.get("variants", [])
                if only and spec.name in only and (v.get("group", ""), v["label"]) not in rerun]
        exp["variants"] = list(kept)
        if kept:  # the folder now holds what several commands ran: list them all
            exp["commands"] = [*previous.get("commands", [previous.get("command", "")]), command]
        start = time.perf_counter()

        def save(entries: list[dict[str, Any]], kept: list[dict[str, Any]] = kept,
                 exp: dict[str, Any] = exp, start: float = start) -> None:
            exp["variants"] = [*kept, *entries]
            exp["runtime_s"] = time.perf_counter() - start
            write_manifest(out, manifest)

        runner = RUNNERS[spec.tool if engine == "ray" else f"{spec.tool}-{engine}"]
        _run_spec(spec, seeds, out, resume=resume, runner=runner, on_run=save,
                  progress=progress, jobs=jobs)
        order = [(v.group, v.label) for v in load_experiment(
            spec.name, dataset=dataset, quick=quick, data_root=data_root).variants]
        exp["variants"].sort(key=lambda v: order.index((v.get("group", ""), v["label"]))
                             if (v.get("group", ""), v["label"]) in order else len(order))
        exp["seeds"] = sorted({r["seed"] for v in exp["variants"] for r in v["runs"]})
        exp["runtime_s"] = sum(r["runtime_s"] for v in exp["variants"] for r in v["runs"])
        write_manifest(out, manifest)
    if report:
        from fedddl.report.build import build_report

        result = build_report(out)
        print(result.markdown)
    return manifest


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the driver."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", nargs="+", default=["all"],
                        choices=[*EXPERIMENTS, "all"], help="which claim(s) to run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                        help="seeds; every configuration runs once per seed (default: 0 1 2)")
    parser.add_argument("--dataset", default="digits",
                        choices=DATASETS, help="dataset of every run (default: digits)")
    parser.add_argument("--data-root", default=None,
                        help="dataset directory (default: $FEDDDL_DATA or the standard place)")
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="results folder (default: results)")
    parser.add_argument("--quick", action="store_true", help="tiny configuration (tests)")
    parser.add_argument("--resume", action="store_true", help="keep finished run files")
    parser.add_argument("--no-report", action="store_true", help="skip report.md / PNGs")
    parser.add_argument("--variants", nargs="+", default=[], metavar="EXPERIMENT:LABEL",
                        help="run only these variants of the named experiments; LABEL is a "
                             "variant's label, or GROUP/LABEL for that label in one group "
                             "only (default: every variant)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time, in worker processes (default: 1)")
    parser.add_argument("--engine", choices=("ray", "inline"), default="ray",
                        help="ray: Flower's simulation engine, as fedddl simulate; inline: the "
                             "same apps in-process without Ray, replies in a fixed order "
                             "(default: ray)")
    parser.add_argument("--print-commands", action="store_true",
                        help="print the equivalent fedddl command lines and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    names = list(EXPERIMENTS) if "all" in args.experiment else list(dict.fromkeys(args.experiment))
    if len(set(args.seeds)) != len(args.seeds):
        print("run_experiments: --seeds must be distinct", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("run_experiments: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:  # resolve every experiment up front: a typo fails in a second, not after runs
        only = parse_only(args.variants)
        specs = [_select(load_experiment(name, dataset=args.dataset, quick=args.quick,
                                         data_root=args.data_root), only.get(name))
                 for name in names]
    except ValueError as exc:
        print(f"run_experiments: {exc}", file=sys.stderr)
        return 2
    if args.print_commands:
        for spec in specs:
            for variant in spec.variants:
                for seed in args.seeds:
                    out = args.out / _variant_dir(spec, variant) / f"seed{seed}.json"
                    print(command_line(spec.tool, {**variant.config, "seed": seed}, out))
        return 0
    given = list(sys.argv[1:] if argv is None else argv)
    # --resume only skips finished runs; the command without it reproduces the results.
    command = shlex.join(["python", "-m", "simulations.run_experiments",
                          *(a for a in given if a != "--resume")])
    runs = sum(len(spec.variants) for spec in specs) * len(args.seeds)
    try:
        with Progress(runs, "experiments", unit="runs", stream=sys.stdout) as progress:
            run_suite(names, args.seeds, args.out, dataset=args.dataset, data_root=args.data_root,
                      quick=args.quick, resume=args.resume, report=not args.no_report,
                      command=command, only=only, progress=progress, jobs=args.jobs,
                      engine=args.engine)
    except RunsFailed as exc:  # the other runs are saved
        print(f"run_experiments: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
