"""Compare run-config settings side by side: accuracy by round, bytes, over several seeds.

Each ``--setting "label: key=value key=value"`` is a set of run-config keys (kebab-case,
Flower's syntax as in ``fedddl simulate --run-config``: strings in quotes) applied on top of
the shared ``--base`` keys; every
setting runs once per seed on the same shards. The runs use the inline engine of
``fedddl simulate --engine inline`` (the same ServerApp and ClientApp as on Ray, without
Ray; replies in a fixed order, so a run replays exactly), ``--jobs`` runs at a time, one
torch thread each.

    python -m simulations.sweep_settings --base "dataset='fashion-mnist' arch='resnet8' \\
        num-server-rounds=200 eval-every=50 eval-samples=2000" \\
        --setting "gradient-average: strategy='gradient-average'" \\
        --setting "terngrad: strategy='terngrad'" \\
        --setting "terngrad shared-sum: strategy='terngrad' downlink='shared-scale-sum'" \\
        --seeds 0,1,2

Scale buckets against TernGrad's per-tensor scale (``scale-bucket``; issue 34's variants),
on a schedule shortened to 150 rounds with the lr steps where the 400-round one has them::

    python -m simulations.sweep_settings --base "dataset='fashion-mnist' arch='resnet8' \
        num-server-rounds=150 lr-milestones='75,112' eval-every=25 eval-samples=2000" \
        --setting "terngrad: strategy='terngrad' scale-bucket=0" \
        --setting "gradient-average: strategy='gradient-average'" \
        --setting "terngrad bucket 512: strategy='terngrad' scale-bucket=512" \
        --setting "terngrad per-channel: strategy='terngrad' scale-bucket=-1" --seeds 0

It prints one line per run as it ends, then a table: per setting and evaluated round the
mean accuracy over seeds with its range, the mean bytes up and down per round, the mean
run time, and each setting's final accuracy minus the first setting's (mean and per seed).
``--json PATH`` also writes every run's rounds; ``--tables A.json B.json ...`` runs nothing
and prints the table of the runs saved in those files, merged (settings in the order they
first appear, or as ``--labels`` lists them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any


def parse_keys(text: str) -> dict[str, Any]:
    """``"a=1 b='x'"`` → ``{"a": 1, "b": "x"}``: Flower's run-config syntax, as in
    ``fedddl simulate --run-config`` (strings in quotes)."""
    from fedddl.flower.run_config import parse_run_config

    return parse_run_config([text]) if text.strip() else {}


def parse_setting(text: str) -> tuple[str, dict[str, Any]]:
    """``"label: a=1 b=2"`` → ``("label", {"a": "1", "b": "2"})``."""
    label, sep, rest = text.partition(":")
    if not sep or not label.strip():
        raise ValueError(f"a setting is 'label: key=value ...', got {text!r}")
    return label.strip(), parse_keys(rest)


def run_one(job: tuple[str, dict[str, Any], int, int]) -> dict[str, Any]:
    """Run one setting with one seed in this process; return its rounds and summary."""
    label, keys, seed, num_clients = job
    from simulations.tool_runners import run_simulate_inline, timed_run

    result, seconds = timed_run(run_simulate_inline,
                                {**keys, "seed": seed, "num-clients": num_clients})
    curve = [(r["round"], r["accuracy"]) for r in result["rounds"] if r["accuracy"] is not None]
    return {
        "label": label,
        "seed": seed,
        "curve": curve,
        "final_accuracy": result["final_accuracy"],
        "bytes_up": result["summary"]["mean_bytes_up"],
        "bytes_down": result["summary"]["mean_bytes_down"],
        "seconds": seconds,
    }


def _table(runs: list[dict[str, Any]], labels: list[str]) -> list[str]:
    lines = []
    by_label = {label: [r for r in runs if r["label"] == label] for label in labels}
    width = max(len(label) for label in labels) + 2
    first = {r["seed"]: r["final_accuracy"] for r in by_label[labels[0]]}
    for label in labels:
        group = sorted(by_label[label], key=lambda r: r["seed"])
        if not group:
            continue
        rounds = [n for n, _ in group[0]["curve"]]
        cells = []
        for i, n in enumerate(rounds):
            accs = [r["curve"][i][1] for r in group if i < len(r["curve"])]
            cells.append(f"r{n} {statistics.mean(accs):.4f} [{min(accs):.4f}, {max(accs):.4f}]")
        up = statistics.mean(r["bytes_up"] for r in group)
        down = statistics.mean(r["bytes_down"] for r in group)
        secs = statistics.mean(r["seconds"] for r in group)
        deltas = [r["final_accuracy"] - first[r["seed"]] for r in group if r["seed"] in first]
        delta = (
            f"final - {labels[0]}: {statistics.mean(deltas):+.4f} "
            f"(per seed {', '.join(f'{d:+.4f}' for d in deltas)})"
            if deltas
            else ""
        )
        lines.append(f"{label:{width}s} " + "; ".join(cells))
        lines.append(
            f"{'':{width}s} bytes/round up {up:,.0f} down {down:,.0f}; {secs:.0f} s/run; {delta}"
        )
    return lines


def _print_saved(paths: list[str], labels_text: str) -> int:
    """Print the table of the runs saved in ``paths`` (``--json`` files), merged."""
    runs = [run for path in paths for run in json.loads(Path(path).read_text())["runs"]]
    found = list(dict.fromkeys(r["label"] for r in runs))
    labels = [s.strip() for s in labels_text.split(",") if s.strip()] or found
    missing = sorted(set(labels) - set(found))
    if missing:
        raise SystemExit(f"no runs labelled {', '.join(missing)} in {', '.join(paths)}")
    seeds = sorted({r["seed"] for r in runs if r["label"] in labels})
    print(f"{len(paths)} file(s); seeds {seeds}")
    print("\n".join(_table([r for r in runs if r["label"] in labels], labels)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="",
                        help="run-config keys shared by every setting, 'key=value ...'")
    parser.add_argument("--setting", action="append", default=[],
                        help="'label: key=value ...' (repeat; the first is the reference)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--num-clients", type=int, default=10, help="clients (default: 10)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default: 2)")
    parser.add_argument("--json", default="", help="also write every run's results here")
    parser.add_argument("--tables", nargs="+", default=[], metavar="JSON",
                        help="run nothing: print the table of the runs saved by --json")
    parser.add_argument("--labels", default="",
                        help="with --tables: comma-separated settings, in this order")
    args = parser.parse_args(argv)
    if args.tables:
        return _print_saved(args.tables, args.labels)
    if not args.setting:
        parser.error("give at least one --setting")
    try:
        base = parse_keys(args.base)
        settings = [parse_setting(s) for s in args.setting]
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError as error:
        parser.error(str(error))
    labels = [label for label, _ in settings]
    if len(set(labels)) != len(labels):
        parser.error("setting labels must differ")
    if any("num-clients" in keys for keys in (base, *(k for _, k in settings))):
        parser.error("num-clients is not a run-config key; give --num-clients")
    if args.jobs < 1 or args.num_clients < 1 or not seeds:
        parser.error("--jobs and --num-clients must be >= 1, --seeds non-empty")
    jobs = [(label, {**base, **keys}, seed, args.num_clients)
            for seed in seeds for label, keys in settings]  # fmt: skip
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for run in pool.map(run_one, jobs):
            runs.append(run)
            curve = ", ".join(f"{n} {a:.4f}" for n, a in run["curve"])
            print(f"{run['label']} seed {run['seed']}: {curve} "
                  f"({run['bytes_up']:,.0f} B up/round, {run['seconds']:.0f} s)", flush=True)
    print(f"\nbase: {args.base or '(defaults)'}; {args.num_clients} clients; seeds {seeds}; "
          f"{time.perf_counter() - start:.0f} s in all, {args.jobs} at a time")
    print("\n".join(_table(runs, labels)))
    if args.json:
        Path(args.json).write_text(json.dumps({"base": base, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
