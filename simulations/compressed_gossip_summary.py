"""Side-by-side ratios of the ``compressed_gossip`` experiment, from its run files.

Usage::

    python -m simulations.compressed_gossip_summary results/digits
    python -m simulations.compressed_gossip_summary results/fmnist-a+results/fmnist-b

For a results folder written by ``run_experiments.py --experiment
compressed_gossip`` (or several folders of one dataset joined by ``+``, e.g. the
variants run in parallel into separate folders with ``--variants``) and every
network, it prints one row per variant: total
bytes (model messages + status messages, mean over seeds), model bytes, the
mean message size, virtual time to the target (mean over the seeds that reached
it, with how many did), final accuracy; then the bytes ratio and time-to-target
of compressed against fp32 scheduled gossip, per seed and on average. Nothing
is estimated: every number is read from the runs' JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "summarize"]

EXPERIMENT = "compressed_gossip"
FP32, COMPRESSED = "scheduled", "scheduled+ternary"


def _runs(roots: list[Path]) -> dict[tuple[str, str], dict[int, dict[str, Any]]]:
    runs: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for root in roots:
        manifest = json.loads((root / "manifest.json").read_text())
        for variant in manifest["experiments"][EXPERIMENT]["variants"]:
            key = (variant.get("group", ""), variant["label"])
            runs.setdefault(key, {}).update(
                {run["seed"]: json.loads((root / run["result"]).read_text())
                 for run in variant["runs"]})
    return runs


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize(spec: str | Path) -> list[str]:
    """The summary lines of one results folder (or ``+``-joined folders of one dataset)."""
    roots = [Path(part) for part in str(spec).split("+")]
    runs = _runs(roots)
    manifest = json.loads((roots[0] / "manifest.json").read_text())
    target = manifest["experiments"][EXPERIMENT].get("target_accuracy")
    hardware = manifest.get("hardware")
    seconds = sum(r.get("_runtime_s", 0.0) for by_seed in runs.values() for r in by_seed.values())
    lines = [f"# {spec} ({manifest.get('dataset')}; target {target}; seeds "
             f"{sorted({s for by_seed in runs.values() for s in by_seed})}; {hardware}; "
             f"{seconds:.0f} s of runs)"]
    header = (f"{'network':14} {'variant':18} {'bytes total':>12} {'model bytes':>12} "
              f"{'B/message':>9} {'to target (s)':>15} {'final acc':>9}")
    lines.append(header)
    for (group, label), by_seed in runs.items():
        results = list(by_seed.values())
        reached = [r["time_to_target_s"] for r in results if r["time_to_target_s"] is not None]
        ttt = f"{_mean(reached):.2f} ({len(reached)}/{len(results)})" if reached else (
            f"never (0/{len(results)})")
        lines.append(
            f"{group:14} {label:18} {_mean([r['bytes_total'] for r in results]):12.4g} "
            f"{_mean([r['model_bytes_total'] for r in results]):12.4g} "
            f"{_mean([r['message_bytes_mean'] or 0 for r in results]):9.0f} {ttt:>15} "
            f"{_mean([r['final_accuracy'] for r in results]):9.3f}"
        )
    for group in sorted({g for g, _ in runs}):
        fp32, small = runs.get((group, FP32), {}), runs.get((group, COMPRESSED), {})
        seeds = sorted(set(fp32) & set(small))
        if not seeds:
            continue
        total = [fp32[s]["bytes_total"] / small[s]["bytes_total"] for s in seeds]
        model = [fp32[s]["model_bytes_total"] / small[s]["model_bytes_total"] for s in seeds]
        times = [(fp32[s]["time_to_target_s"], small[s]["time_to_target_s"]) for s in seeds]
        lines.append(
            f"{group}: fp32/compressed bytes total {_mean(total):.1f}x "
            f"(per seed {', '.join(f'{x:.1f}' for x in total)}), model bytes "
            f"{_mean(model):.1f}x; time to target fp32 vs compressed per seed: "
            + ", ".join(f"{a} vs {b}" for a, b in times)
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the summary of every folder given."""
    folders = list(sys.argv[1:] if argv is None else argv)
    if not folders:
        print(__doc__)
        return 2
    for folder in folders:
        print("\n".join(summarize(folder)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
