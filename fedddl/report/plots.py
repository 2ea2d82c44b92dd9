"""Matplotlib figures of the experiment report (Agg backend, small PNGs).

Every curve is drawn as the mean over seeds with a shaded min/max band, so
each figure shows its spread; the legend states the number of seeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedddl.report.stats import Band

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "DPI", "plot_bands", "plot_final_bars", "plot_outcome_vs_shards", "plot_shards", "save_figure",
]

#: Resolution of every saved figure; with the sizes below PNGs stay well under 150 KB.
DPI = 90


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CI or the 2-core box
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, path: Path, dpi: int = DPI) -> Path:
    """Save ``fig`` as PNG at ``dpi`` (default :data:`DPI`) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def _draw_band(ax: Axes, band: Band, label: str, color: Any) -> None:
    ax.plot(band.x, band.mean, color=color, lw=1.6, label=f"{label} (n={band.num_seeds})")
    if band.num_seeds > 1:
        ax.fill_between(band.x, band.low, band.high, color=color, alpha=0.2, lw=0)


def plot_bands(
    panels: Sequence[tuple[str, str, Mapping[str, Band]]],
    path: Path,
    *,
    suptitle: str,
    ylabel: str = "test accuracy",
    target: float | None = None,
    log_x: Sequence[bool] | None = None,
    columns: int | None = None,
) -> Path:
    """Panels in rows, each with one mean curve + min/max band per configuration.

    Parameters
    ----------
    panels : sequence of (title, xlabel, {label: Band})
        What to draw in each panel.
    path : Path
        PNG to write.
    suptitle : str
        Figure title.
    ylabel : str
        Y axis label, shared.
    target : float, optional
        Draws the target accuracy as a dotted line.
    log_x : sequence of bool, optional
        Per panel, whether the x axis is logarithmic.
    columns : int, optional
        Panels per row (default: all in one row).

    Returns
    -------
    Path
        ``path``.
    """
    plt = _pyplot()
    n = len(panels)
    cols = n if columns is None else max(1, min(columns, n))
    nrows = -(-n // cols)
    width = 4.0 if cols <= 3 else 3.0  # keep wide figures (ternary: 5 panels) small on disk
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols, 3.2 * nrows), squeeze=False,
                             sharey=True)
    colors = plt.get_cmap("tab10")
    labels: list[str] = []
    for _, _, bands in panels:
        labels.extend(k for k in bands if k not in labels)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for i, (title, xlabel, bands) in enumerate(panels):
        ax = axes.flat[i]
        for label, band in bands.items():
            _draw_band(ax, band, label, colors(labels.index(label) % 10))
        if target is not None:
            ax.axhline(target, color="grey", ls=":", lw=1)
        if log_x is not None and log_x[i]:
            ax.set_xscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    for row in axes:
        row[0].set_ylabel(ylabel, fontsize=8)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    # Noisy curves in 5 panels exceed 150 KB at 90 dpi; 75 dpi keeps them legible and small.
    return save_figure(fig, path, dpi=DPI if n <= 3 else 75 if n <= 6 else 60)


def plot_final_bars(
    values: Mapping[str, Mapping[str, tuple[float, float]]],
    path: Path,
    *,
    suptitle: str,
    ylabel: str = "final test accuracy",
) -> Path:
    """Grouped bars: per group, one bar per configuration (mean, std as an error bar).

    Parameters
    ----------
    values : {group: {label: (mean, std)}}
        What to draw; labels keep their colour across groups.
    path : Path
        PNG to write.
    suptitle : str
        Figure title.
    ylabel : str
        Y axis label.

    Returns
    -------
    Path
        ``path``.
    """
    plt = _pyplot()
    labels: list[str] = []
    for by_label in values.values():
        labels.extend(k for k in by_label if k not in labels)
    groups = list(values)
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.22 * len(groups) * len(labels) + 2)), 3.6))
    colors = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i, g in enumerate(groups)
              if label in values[g]]
        stats = [values[g][label] for g in groups if label in values[g]]
        ax.bar(xs, [m for m, _ in stats], width=width, yerr=[sd for _, sd in stats],
               color=colors(j % 10), label=label, capsize=2, error_kw={"lw": 0.8})
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_outcome_vs_shards(
    points: Sequence[Mapping[str, Any]],
    path: Path,
    *,
    suptitle: str,
    stats: Sequence[tuple[str, str]],
    outcome: str,
    outcome_label: str,
) -> Path:
    """Scatter a training outcome of each run against statistics of its shards.

    Parameters
    ----------
    points : sequence of dict
        One per run: ``label`` (colour), the keys named in ``stats`` and ``outcome``.
    path : Path
        PNG to write.
    suptitle : str
        Figure title.
    stats : sequence of (key, axis label)
        One panel per shard statistic (x axis logarithmic, linear near 0).
    outcome, outcome_label : str
        The y key and its axis label (shared by the panels).

    Returns
    -------
    Path
        ``path``.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(stats), figsize=(3.8 * len(stats), 3.2), squeeze=False,
                             sharey=True)
    colors = plt.get_cmap("tab10")
    labels = list(dict.fromkeys(str(p["label"]) for p in points))
    for ax, (key, xlabel) in zip(axes[0], stats, strict=True):
        for i, label in enumerate(labels):
            mine = [p for p in points if p["label"] == label
                    and np.isfinite(p.get(key, np.nan)) and np.isfinite(p.get(outcome, np.nan))]
            ax.scatter([p[key] for p in mine], [p[outcome] for p in mine], s=12, alpha=0.7,
                       color=colors(i % 10), label=label)
        # Logarithmic above the smallest positive value, linear below it: stratified
        # shards have a class-mix KL of exactly 0.
        positive = [p[key] for p in points if np.isfinite(p.get(key, np.nan)) and p[key] > 0]
        ax.set_xscale("symlog", linthresh=min(positive) / 2 if positive else 1e-6)
        ax.set_xlim(left=0)
        ax.axhline(0.0, color="grey", lw=0.6)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(outcome_label, fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_shards(reports: Mapping[str, Mapping[str, Any]], path: Path, *, suptitle: str) -> Path:
    """Per-shard class proportions (top) and feature statistics (bottom) per partition.

    Parameters
    ----------
    reports : {label: shard_report dict}
        One :func:`fedddl.partition.shard_report` result per partitioning.
    path : Path
        PNG to write.
    suptitle : str
        Figure title.

    Returns
    -------
    Path
        ``path``.
    """
    plt = _pyplot()
    n = len(reports)
    has_features = all("feature_mean" in r["shards"][0] for r in reports.values())
    rows = 2 if has_features else 1
    fig, axes = plt.subplots(rows, n, figsize=(3.6 * n, 2.8 * rows), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for j, (label, report) in enumerate(reports.items()):
        shards = report["shards"]
        props = np.array([s["class_proportions"] for s in shards], dtype=np.float64)
        ids = np.arange(len(shards))
        ax = axes[0][j]
        bottom = np.zeros(len(shards))
        for c, cls in enumerate(report["classes"]):
            ax.bar(ids, props[:, c], bottom=bottom, color=cmap(c % 10), width=0.85,
                   label=str(cls))
            bottom += props[:, c]
        kl = report["summary"].get("kl_divergence_mean", float("nan"))
        ax.set_title(f"{label}: class mix per shard\nmean KL to global = {kl:.2g}", fontsize=8)
        ax.set_xlabel("shard", fontsize=8)
        ax.set_ylim(0, 1)
        ax.tick_params(labelsize=7)
        if j == 0:
            ax.set_ylabel("class proportion", fontsize=8)
        if has_features:
            ax2 = axes[1][j]
            # Deviations from the global statistics: the raw values differ by < 5 %,
            # invisible on bars that start at 0.
            mean = np.array([s["feature_mean"] for s in shards]) - report["global"]["feature_mean"]
            var = np.array([s["feature_var"] for s in shards]) - report["global"]["feature_var"]
            ax2.bar(ids - 0.2, mean, width=0.4, label="pixel mean", color="tab:blue")
            ax2.bar(ids + 0.2, var, width=0.4, label="pixel variance", color="tab:orange")
            ax2.axhline(0.0, color="black", lw=0.6)
            ax2.set_title(f"{label}: shard minus global pixel stats", fontsize=8)
            ax2.set_xlabel("shard", fontsize=8)
            ax2.tick_params(labelsize=7)
            if j == 0:
                ax2.set_ylabel("difference", fontsize=8)
                ax2.legend(fontsize=6)
    if has_features:  # one scale for the whole row, so partitions compare at a glance
        limit = max(max(abs(v) for v in ax.get_ylim()) for ax in axes[1])
        for ax in axes[1]:
            ax.set_ylim(-limit, limit)
    if len(next(iter(reports.values()))["classes"]) <= 20:  # 100 classes: no legend
        axes[0][-1].legend(fontsize=5, title="class", title_fontsize=6, loc="upper left",
                           bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
