"""Mean and standard error over seeds of the drop-in's accuracy difference to plain.

Reads ``simulations.bench_dropin_accuracy --out`` files; for each strategy, local epochs and
variant, pairs every seed's run with the plain run of the same seed and prints the mean
difference (points) ± its standard error over seeds at rounds 5, 15 and 50 and over the
windows 4-6, 13-15 and 46-50 (a window's mean per seed, then over seeds), where the runs are
that long. A run is paired only with a plain run of the same settings
(:data:`simulations.bench_dropin_accuracy.SAME_SETTINGS`, as ``--baseline`` does), and runs
of other settings are summed up apart, their line naming the settings that differ from the
most common ones (e.g. ``[fraction=1.0]``). A file named ``plain:PATH`` contributes only its
plain runs (earlier baselines).

    python -m simulations.dropin_seed_summary plain:docs/results/dropin-accuracy/diag1.json \\
        docs/results/dropin-accuracy/projected-e1-s012.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from simulations.bench_dropin_accuracy import SAME_SETTINGS

#: (label, first round, last round) of each column.
COLUMNS = [("r5", 5, 5), ("r4-6", 4, 6), ("r15", 15, 15), ("r13-15", 13, 15), ("r50", 50, 50),
           ("r46-50", 46, 50)]


def load(paths: list[str]) -> list[dict[str, Any]]:
    """Every run of the files (only the plain ones of a ``plain:`` file), each with its
    file's :data:`SAME_SETTINGS` under ``"settings"``."""
    runs = []
    for spec in paths:
        only_plain = spec.startswith("plain:")
        saved = json.loads(Path(spec.removeprefix("plain:")).read_text())
        settings = tuple(saved["args"].get(k) for k in SAME_SETTINGS)
        for run in saved["results"]:
            if not only_plain or run["variant"] == "plain":
                runs.append({**run, "settings": settings})
    return runs


Settings = tuple[Any, ...]
Differences = dict[tuple[str, int, str, Settings], dict[int, dict[int, float]]]


def differences(runs: list[dict[str, Any]]) -> Differences:
    """(strategy, epochs, variant, settings) -> seed -> round -> accuracy minus that of the
    plain run of the same seed and settings (the last run read of a seed and variant wins)."""
    def key(run: dict[str, Any]) -> tuple[Any, ...]:
        return run["strategy"], run["epochs"], run["seed"], run["settings"]

    plain = {key(run): {r["round"]: r["accuracy"] for r in run["rounds"]}
             for run in runs if run["variant"] == "plain"}
    out: Differences = {}
    for run in runs:
        base = plain.get(key(run))
        if run["variant"] == "plain" or base is None:
            continue
        group = run["strategy"], run["epochs"], run["variant"], run["settings"]
        out.setdefault(group, {})[run["seed"]] = {
            r["round"]: r["accuracy"] - base[r["round"]] for r in run["rounds"]
            if r["round"] in base}
    return out


def summary_lines(diffs: Differences) -> list[str]:
    """One line per (strategy, epochs, variant, settings): seeds, then ``column mean±se`` in
    points; settings other than the most common ones are named after the variant."""
    common = Counter(group[3] for group in diffs).most_common(1)
    usual: Settings = common[0][0] if common else ()
    lines = []
    for (strategy, epochs, variant, settings), seeds in sorted(diffs.items(), key=repr):
        named = zip(SAME_SETTINGS, settings, usual, strict=True)
        other = [f"{k}={v}" for k, v, u in named if v != u]
        if other:
            variant = f"{variant} [{', '.join(other)}]"
        cells = []
        for label, first, last in COLUMNS:
            if not all(all(r in d for r in range(first, last + 1)) for d in seeds.values()):
                continue
            values = [100 * statistics.mean(d[r] for r in range(first, last + 1))
                      for d in seeds.values()]
            se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
            cells.append(f"{label} {statistics.mean(values):+.2f}±{se:.2f}")
        lines.append(f"{strategy} E{epochs} {variant} seeds={sorted(seeds)}: " + " ".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="--out files of bench_dropin_accuracy "
                        "(plain:PATH for plain runs only)")
    args = parser.parse_args(argv)
    print("\n".join(summary_lines(differences(load(args.files)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
