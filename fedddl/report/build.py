"""Turn a results folder written by ``simulations/run_experiments.py`` into plots and tables.

:func:`build_report` reads ``RESULTS_DIR/manifest.json`` (see
:mod:`fedddl.report.manifest`), aggregates every configuration over its seeds
(mean, std, min/max) and writes, into the same folder:

- ``report.md``: one section per experiment with its claim, a Markdown table
  (one row per configuration) and the figures;
- ``summary.csv``: the same rows, machine-readable;
- ``<experiment>_*.png``: accuracy against rounds / bytes / simulated time
  (server experiments) or against virtual time (gossip), and per-shard
  statistics for the sharding experiment.

The simulated wall-time model used for the bandwidth panels is documented in
:mod:`fedddl.report.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedddl.report.manifest import ManifestError, load_json, load_manifest
from fedddl.report.plots import (
    plot_bands,
    plot_final_bars,
    plot_outcome_vs_shards,
    plot_shards,
)
from fedddl.report.stats import (
    Band,
    Link,
    aggregate_rounds,
    band_on_grid,
    first_reach,
    mean_std,
    round_series,
    simulated_round_times,
)
from fedddl.report.tables import Table, fmt_count, fmt_pm, fmt_reach, markdown_table, write_csv

__all__ = ["Report", "Section", "build_report"]

_MB = 1e6
_LAST = 5  # "last evaluations" column: the mean of each run's last 5 evaluations
_ORDER = ("sharding", "sharding_at_scale", "ternary", "ternary_resnet8", "gossip",
          "compressed_gossip", "robustness")


@dataclass
class Section:
    """One experiment's part of the report."""

    name: str
    title: str
    claim: str
    table: Table
    figures: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runtime_s: float | None = None
    commands: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    overview: Table | None = None


@dataclass
class Report:
    """What :func:`build_report` wrote."""

    markdown: str
    markdown_path: Path
    csv_path: Path
    figures: list[Path]
    sections: list[Section]


def _commands(exp: dict[str, Any]) -> list[str]:
    """The command(s) that produced an experiment's runs, in order."""
    commands = exp.get("commands") or [exp.get("command", "")]
    return [str(c) for c in commands if c]


def _links(exp: dict[str, Any]) -> list[Link]:
    return [Link(str(d["name"]), float(d["bandwidth_Bps"]), float(d["latency_s"]))
            for d in exp.get("links", [])]


def _check_accuracy(values: np.ndarray, where: str) -> None:
    if values.size == 0 or not np.all((values >= 0.0) & (values <= 1.0)):
        raise ManifestError(f"{where}: accuracies must be in [0, 1]")


def _simulate_section(name: str, exp: dict[str, Any], root: Path) -> Section:
    target = float(exp["target_accuracy"])
    links = _links(exp)
    columns = ["Configuration", "Seeds", "Final accuracy", f"Last {_LAST} evaluations",
               "Best accuracy",
               f"Rounds to {target:.2f}", f"Measured time to {target:.2f} (s)", "MB / round",
               f"MB to {target:.2f}"]
    columns += [f"Sim. time to {target:.2f} @ {link.name} (s)" for link in links]
    has_shards = any("shards" in r for v in exp["variants"] for r in v["runs"])
    if has_shards:
        columns += ["Shard KL to global", "Shard max |Δp|", "Pixel-mean dev", "Pixel-var dev"]
    table = Table(exp.get("title", name), columns)
    by_round: dict[str, Band] = {}
    by_bytes: dict[str, Band] = {}
    by_wall: dict[str, Band] = {}
    by_link: dict[str, dict[str, Band]] = {link.name: {} for link in links}
    shard_reports: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Band]] = {}
    for variant in exp["variants"]:
        group = str(variant.get("group", ""))
        label = f"{group}: {variant['label']}" if group else variant["label"]
        series = []
        for run in variant["runs"]:
            try:
                s = round_series(load_json(root / run["result"]))
            except ValueError as exc:
                raise ManifestError(f"{root / run['result']}: {exc}") from exc
            _check_accuracy(s["accuracy"], f"{name}/{label} seed {run['seed']}")
            series.append(s)
        if not series:
            continue
        acc = [s["accuracy"] for s in series]
        by_round[label] = aggregate_rounds([s["round"] for s in series], acc)
        groups.setdefault(group, {})[variant["label"]] = by_round[label]
        by_bytes[label] = aggregate_rounds([s["cum_bytes"] / _MB for s in series], acc)
        by_wall[label] = aggregate_rounds([s["cum_wall_s"] for s in series], acc)
        final = mean_std(float(a[-1]) for a in acc)
        best = mean_std(float(a.max()) for a in acc)
        last = mean_std(float(a[-_LAST:].mean()) for a in acc)  # one evaluation is noisy
        rounds = mean_std(first_reach(s["round"], s["accuracy"], target) for s in series)
        wall = mean_std(first_reach(s["cum_wall_s"], s["accuracy"], target) for s in series)
        per_round = mean_std(
            float((s["bytes_up"] + s["bytes_down"])[s["bytes_up"] + s["bytes_down"] > 0].mean())
            / _MB if np.any(s["bytes_up"] + s["bytes_down"] > 0) else 0.0
            for s in series
        )
        to_target_mb = mean_std(first_reach(s["cum_bytes"] / _MB, s["accuracy"], target)
                                for s in series)
        cells = [label, str(len(series)), fmt_pm(final[0], final[1]), fmt_pm(last[0], last[1]),
                 fmt_pm(best[0], best[1]),
                 fmt_reach(*rounds), fmt_reach(*wall), f"{per_round[0]:.3f}",
                 fmt_reach(*to_target_mb, digits=2)]
        raw: dict[str, object] = {
            "configuration": label, "group": group, "variant": variant["label"],
            "seeds": len(series), "target_accuracy": target,
            "final_accuracy_by_seed": {r["seed"]: float(a[-1])
                                       for r, a in zip(variant["runs"], acc, strict=True)},
            "final_accuracy_mean": final[0], "final_accuracy_std": final[1],
            "last_evaluations_mean": last[0], "last_evaluations_std": last[1],
            "best_accuracy_mean": best[0], "rounds_to_target_mean": rounds[0],
            "rounds_to_target_std": rounds[1], "seeds_reached_target": rounds[2],
            "measured_time_to_target_s_mean": wall[0], "mb_per_round": per_round[0],
            "mb_to_target_mean": to_target_mb[0],
        }
        for link in links:
            times = [simulated_round_times(s, link) for s in series]
            by_link[link.name][label] = aggregate_rounds(times, acc)
            sim = mean_std(first_reach(t, s["accuracy"], target)
                           for t, s in zip(times, series, strict=True))
            cells.append(fmt_reach(*sim, digits=2))
            raw[f"sim_time_to_target_s_mean@{link.name}"] = sim[0]
            raw[f"sim_total_time_s_mean@{link.name}"] = float(np.mean([t[-1] for t in times]))
        if has_shards:
            reports = [load_json(root / r["shards"]) for r in variant["runs"] if "shards" in r]
            raw["shard_summary_by_seed"] = {r["seed"]: rep["summary"] for r, rep in zip(
                [r for r in variant["runs"] if "shards" in r], reports, strict=True)}
            # "all clients" variants share shards; of a matrix, the first group's
            if reports[0] not in shard_reports.values() and variant["label"] not in shard_reports:
                shard_reports[variant["label"]] = reports[0]
            for key, col in (("kl_divergence_mean", "kl"), ("max_abs_deviation_mean", "max_dp"),
                             ("feature_mean_abs_dev_mean", "pixel_mean_dev"),
                             ("feature_var_abs_dev_mean", "pixel_var_dev")):
                stat = mean_std(r["summary"].get(key) for r in reports)
                cells.append("n/a" if stat[2] == 0 else f"{stat[0]:.2g}")
                raw[f"shard_{col}"] = stat[0]
        table.add(cells, raw)

    figures: list[Path] = []
    title = f"{exp.get('title', name)} ({exp.get('dataset', '')})".replace(" ()", "")
    if len(groups) > 1:  # a matrix: one accuracy panel per group, nothing else per round
        finals = {group: {str(raw["variant"]): (_number(raw, "final_accuracy_mean"),
                                                _number(raw, "final_accuracy_std"))
                          for raw in raws}
                  for group, raws in _rows_by_group(table).items()}
        figures.append(plot_final_bars(finals, root / f"{name}_final.png",
                                       suptitle=f"{title}: final accuracy (mean ± std)"))
        figures.append(plot_bands([(g, "round", bands) for g, bands in groups.items()],
                                  root / f"{name}_accuracy.png", suptitle=title,
                                  target=target, columns=min(len(groups), 3)))
        if has_shards:
            figures.append(_outcome_figure(table, root / f"{name}_outcome_vs_shards.png",
                                           title))
    panels: list[tuple[str, str, dict[str, Band]]] = [
        ("accuracy per round", "round", by_round),
    ]
    if len(groups) > 1:
        panels = []
    elif links:
        panels.append(("bytes communicated", "MB (up + down, all clients)",
                       by_bytes))
        panels += [(f"simulated time, {link.name} server link",
                    "simulated wall time (s)", by_link[link.name]) for link in links]
    else:
        panels.append(("accuracy vs measured wall time", "wall time (s)", by_wall))
    if panels:
        figures.append(plot_bands(panels, root / f"{name}_accuracy.png", suptitle=title,
                                  target=target,
                                  log_x=[False, bool(links)] + [False] * len(links)))
    if shard_reports:
        figures.append(plot_shards(shard_reports, root / f"{name}_shards.png",
                                   suptitle=f"{title}: per-shard statistics (seed "
                                            f"{exp['variants'][0]['runs'][0]['seed']})"))
    overview = _overview(table, target) if len(groups) > 1 else None
    return Section(name, exp.get("title", name), exp.get("claim", ""), table, figures,
                   _simulate_notes(table, links, grouped=len(groups) > 1), exp.get("runtime_s"),
                   _commands(exp), list(exp.get("seeds", [])), overview)


def _rows_by_group(table: Table) -> dict[str, list[dict[str, object]]]:
    """The table's raw rows by their group, groups and rows in table order."""
    by_group: dict[str, list[dict[str, object]]] = {}
    for raw in table.raw:
        by_group.setdefault(str(raw["group"]), []).append(raw)
    return by_group


def _by_seed(raw: dict[str, object], key: str) -> dict[Any, Any]:
    """A per-seed raw value (``{seed: value}``), empty when the row has none."""
    value = raw.get(key)
    return dict(value) if isinstance(value, dict) else {}


def outcome_points(table: Table, reference: str = "stratified") -> list[dict[str, Any]]:
    """Per run of a matrix sharding experiment: shard statistics and the accuracy gap.

    ``gap`` is the run's final accuracy minus that of the ``reference`` variant in the
    same group with the same seed (the same workers, steps and participation), so runs
    of different settings share one scale; runs without such a reference are left out.
    """
    finals: dict[tuple[str, str], dict[Any, float]] = {}
    for raw in table.raw:
        finals[(str(raw["group"]), str(raw["variant"]))] = _by_seed(raw, "final_accuracy_by_seed")
    points = []
    for raw in table.raw:
        ref = finals.get((str(raw["group"]), reference), {})
        shards = _by_seed(raw, "shard_summary_by_seed")
        for seed, final in finals[(str(raw["group"]), str(raw["variant"]))].items():
            if seed in ref and seed in shards:
                points.append({"label": raw["variant"], "group": raw["group"], "seed": seed,
                               "gap": final - ref[seed], **shards[seed]})
    return points


def _outcome_figure(table: Table, path: Path, title: str) -> Path:
    return plot_outcome_vs_shards(
        outcome_points(table), path, suptitle=f"{title}: final accuracy vs shard statistics",
        stats=[("kl_divergence_mean", "mean KL(shard class mix || global)"),
               ("feature_mean_abs_dev_mean", "mean |shard - global| pixel mean"),
               ("feature_var_abs_dev_mean", "mean |shard - global| pixel variance")],
        outcome="gap", outcome_label="final accuracy - stratified (same setting, seed)")


def _number(raw: dict[str, object], key: str) -> float:
    value = raw.get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def _overview(table: Table, target: float) -> Table:
    """One row per group, one column per variant: final accuracy and rounds to target."""
    variants = list(dict.fromkeys(str(raw["variant"]) for raw in table.raw))
    overview = Table(f"{table.title}: final accuracy ± std / mean of the last {_LAST} "
                     f"evaluations (rounds to {target:.2f}, seeds that reached it)",
                     ["Setting", *variants])
    for group, raws in _rows_by_group(table).items():
        cells: dict[str, str] = {}
        for raw in raws:
            rounds = _number(raw, "rounds_to_target_mean")
            reached, seeds = int(_number(raw, "seeds_reached_target")), int(_number(raw, "seeds"))
            cells[str(raw["variant"])] = (
                fmt_pm(_number(raw, "final_accuracy_mean"), _number(raw, "final_accuracy_std"))
                + f" / {_number(raw, 'last_evaluations_mean'):.3f}"
                + f" ({'–' if np.isnan(rounds) else f'{rounds:.1f}'}, {reached}/{seeds})")
        overview.add([group, *(cells.get(v, "") for v in variants)], {"group": group})
    return overview


def _paired(raws: list[dict[str, object]]) -> str:
    """``"; final accuracy - REF, seed by seed: B +0.010 (+0.02, 0.00, +0.01), ..."``.

    REF is the group's first variant; only seeds both ran are compared.
    """
    ref = _by_seed(raws[0], "final_accuracy_by_seed")
    parts = []
    for raw in raws[1:]:
        mine = _by_seed(raw, "final_accuracy_by_seed")
        diffs = [mine[seed] - ref[seed] for seed in mine if seed in ref]
        if diffs:
            parts.append(f"{raw['variant']} {float(np.mean(diffs)):+.3f} ("
                         + ", ".join(f"{d:+.3f}" for d in diffs) + ")")
    if not parts:
        return ""
    return f"; final accuracy - {raws[0]['variant']}, seed by seed: " + ", ".join(parts)


def _simulate_notes(table: Table, links: list[Link], *, grouped: bool = False) -> list[str]:
    """Data-driven one-liners: who reached the target first, by rounds and by link time.

    A configuration's value is its mean over the seeds that reached the target,
    so each entry also says how many did (reaching by round and by time coincide).
    With ``grouped`` (a matrix experiment) there is one line per group.
    """

    def ranking(key: str, raws: list[dict[str, object]], name: str) -> str:
        rows = [r for r in raws if not np.isnan(_number(r, key))]
        rows.sort(key=lambda r: _number(r, key))
        missed = [str(r[name]) for r in raws if r not in rows]
        text = " < ".join(
            f"{r[name]} ({_number(r, key):.3g}, "
            f"{int(_number(r, 'seeds_reached_target'))}/{int(_number(r, 'seeds'))})"
            for r in rows
        )
        if not rows:
            return f"none reached it ({', '.join(missed)})"
        return text + (f"; never reached: {', '.join(missed)}" if missed else "")

    if grouped:
        return [f"{group}: rounds to target: "
                + ranking("rounds_to_target_mean", raws, "variant") + _paired(raws)
                for group, raws in _rows_by_group(table).items()]
    notes = ["Rounds to target (mean over the seeds that reached it): "
             + ranking("rounds_to_target_mean", table.raw, "configuration")]
    notes.extend(f"Simulated time to target @ {link.name} (s): "
                 + ranking(f"sim_time_to_target_s_mean@{link.name}", table.raw, "configuration")
                 for link in links)
    return notes


def _gossip_section(name: str, exp: dict[str, Any], root: Path) -> Section:
    target = float(exp["target_accuracy"])
    table = Table(exp.get("title", name),
                  ["Network", "Scheduler", "Seeds", "Final accuracy",
                   f"Virtual time to {target:.2f} (s)", "Bytes total", "Messages", "Stale merges"])
    groups: dict[str, dict[str, Band]] = {}
    reach: dict[str, dict[str, tuple[float, float, int, int]]] = {}
    for variant in exp["variants"]:
        label, group = variant["label"], variant.get("group", "")
        results = [load_json(root / run["result"]) for run in variant["runs"]]
        if not results:
            continue
        curves = []
        for run, res in zip(variant["runs"], results, strict=True):
            curve = np.asarray(res.get("curve", []), dtype=np.float64)
            if curve.ndim != 2 or curve.shape[0] == 0:
                raise ManifestError(f"{name}/{label} seed {run['seed']}: empty curve")
            _check_accuracy(curve[:, 1], f"{name}/{label} seed {run['seed']}")
            curves.append(curve)
        groups.setdefault(group, {})[label] = band_on_grid([c.tolist() for c in curves])
        final = mean_std(float(c[-1, 1]) for c in curves)
        ttt = mean_std(
            (float(r["time_to_target_s"]) if r.get("time_to_target_s") is not None else None)
            if "time_to_target_s" in r else first_reach(c[:, 0], c[:, 1], target)
            for r, c in zip(results, curves, strict=True)
        )
        reach.setdefault(group, {})[label] = ttt
        nbytes = mean_std(float(r.get("bytes_total", 0)) for r in results)
        msgs = mean_std(float(r.get("messages", 0)) for r in results)
        stale = mean_std(float(r.get("stale_merges", 0)) for r in results)
        table.add(
            [group, label, str(len(results)), fmt_pm(final[0], final[1]), fmt_reach(*ttt, 2),
             fmt_count(nbytes[0]) + "B", fmt_count(msgs[0]), f"{stale[0]:.1f}"],
            {"network": group, "configuration": label, "seeds": len(results),
             "target_accuracy": target, "final_accuracy_mean": final[0],
             "final_accuracy_std": final[1], "time_to_target_s_mean": ttt[0],
             "time_to_target_s_std": ttt[1], "seeds_reached_target": ttt[2],
             "bytes_total_mean": nbytes[0], "messages_mean": msgs[0],
             "stale_merges_mean": stale[0]},
        )
    title = f"{exp.get('title', name)} ({exp.get('dataset', '')})".replace(" ()", "")
    panels = [(f"{group or 'network'} network", "virtual time (s)", bands)
              for group, bands in groups.items()]
    figure = plot_bands(panels, root / f"{name}_accuracy.png", suptitle=title, target=target)
    notes = []
    for group, by_label in reach.items():
        parts = [f"{label}: " + (f"{m:.3g} s ({k}/{n})" if k else f"not reached (0/{n})")
                 for label, (m, _, k, n) in by_label.items()]
        notes.append(f"{group or 'network'}: time to target " + "; ".join(parts))
    return Section(name, exp.get("title", name), exp.get("claim", ""), table, [figure], notes,
                   exp.get("runtime_s"), _commands(exp), list(exp.get("seeds", [])))


def _render(manifest: dict[str, Any], sections: list[Section]) -> str:
    lines = [
        "# fedddl experiment report",
        "",
        f"- dataset: `{manifest.get('dataset', '?')}`"
        + ("; **quick mode** (tiny configuration, not a result)" if manifest.get("quick")
           else ""),
        f"- hardware: {manifest.get('hardware', 'unknown')}",
    ]
    lines.append("- curves: mean over seeds, shaded band = min/max; tables: mean ± std")
    for section in sections:
        lines += ["", f"## {section.title}", ""]
        if section.claim:
            lines += [f"Claim: {section.claim}", ""]
        facts = []
        if section.seeds:
            facts.append("seeds " + ", ".join(str(s) for s in section.seeds))
        if section.runtime_s is not None:
            facts.append(f"runtime {section.runtime_s:.0f} s (sum of its runs)")
        if facts:
            lines += ["; ".join(facts).capitalize(), ""]
        if section.commands:
            lines += ["```bash", *section.commands, "```", ""]
        if section.overview is not None:
            lines += [markdown_table(section.overview), ""]
        lines += [markdown_table(section.table), ""]
        lines += [f"- {note}" for note in section.notes]
        lines += [""] + [f"![{fig.stem}]({fig.name})" for fig in section.figures]
    return "\n".join(lines) + "\n"


def build_report(results_dir: str | Path) -> Report:
    """Write ``report.md``, ``summary.csv`` and the PNGs of a results folder.

    Parameters
    ----------
    results_dir : str or Path
        A folder written by ``simulations/run_experiments.py``.

    Returns
    -------
    Report
        The Markdown text and the paths written.

    Raises
    ------
    ManifestError
        If the folder, its manifest or a run file is missing or malformed.
    """
    root = Path(results_dir)
    manifest = load_manifest(root)
    sections: list[Section] = []
    names = sorted(manifest["experiments"],  # the order of the README, then the rest
                   key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))
    for name in names:
        exp = {"dataset": manifest.get("dataset", ""), **manifest["experiments"][name]}
        if not exp["variants"]:
            continue
        build = _simulate_section if exp["tool"] == "simulate" else _gossip_section
        sections.append(build(name, exp, root))
    if not sections:
        raise ManifestError(f"{root}: the manifest lists no experiment with runs")
    text = _render(manifest, sections)
    md_path = root / "report.md"
    md_path.write_text(text)
    csv_path = write_csv([(s.name, s.table) for s in sections], root / "summary.csv")
    figures = [f for s in sections for f in s.figures]
    return Report(text, md_path, csv_path, figures, sections)
