"""Markdown and CSV tables of the experiment report."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Table", "fmt_count", "fmt_pm", "fmt_reach", "markdown_table", "write_csv"]


class Table:
    """A titled table: display cells for Markdown plus raw values for CSV.

    Parameters
    ----------
    title : str
        Heading shown above the Markdown table.
    columns : sequence of str
        Column names, shared by both forms.
    """

    def __init__(self, title: str, columns: Sequence[str]) -> None:
        self.title = title
        self.columns = list(columns)
        self.rows: list[list[str]] = []
        self.raw: list[dict[str, object]] = []

    def add(self, cells: Sequence[str], raw: dict[str, object]) -> None:
        """Append a row; ``cells`` must match ``columns`` one to one."""
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells, table {self.title!r} has "
                             f"{len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])
        self.raw.append(raw)


def fmt_pm(mean: float, std: float, digits: int = 3) -> str:
    """``mean ± std``, or ``n/a`` for NaN."""
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def fmt_reach(mean: float, std: float, reached: int, total: int, digits: int = 1) -> str:
    """Time/rounds to target over the seeds that reached it, with how many did."""
    if reached == 0:
        return f"not reached (0/{total})"
    return f"{mean:.{digits}f} ± {std:.{digits}f} ({reached}/{total})"


def fmt_count(value: float) -> str:
    """Large counts with SI-ish suffixes (bytes, messages)."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.2f} {suffix}"
    return f"{value:.0f}"


def markdown_table(table: Table) -> str:
    """Render as a GitHub Markdown table (``|`` in cells escaped)."""

    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = [
        "| " + " | ".join(esc(c) for c in table.columns) + " |",
        "| " + " | ".join("---" for _ in table.columns) + " |",
    ]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def write_csv(tables: Sequence[tuple[str, Table]], path: Path) -> Path:
    """One CSV row per configuration of every experiment (``experiment`` column first).

    Nested raw values (per-seed details for the figures) stay out of the CSV.
    """

    def flat(raw: dict[str, object]) -> dict[str, object]:
        return {k: v for k, v in raw.items() if not isinstance(v, (dict, list))}

    keys: list[str] = ["experiment"]
    for _, table in tables:
        for raw in table.raw:
            keys.extend(k for k in flat(raw) if k not in keys)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        for name, table in tables:
            for raw in table.raw:
                writer.writerow({"experiment": name, **flat(raw)})
    return path
