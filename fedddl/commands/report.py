"""``fedddl report RESULTS_DIR``: plots and a Markdown table from an experiment results folder."""

from __future__ import annotations

import argparse
import sys

__all__ = ["HELP", "NAME", "add_arguments", "run"]

NAME = "report"
HELP = "turn an experiment results folder into report.md, summary.csv and PNG plots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the positional results folder."""
    parser.add_argument(
        "results_dir",
        metavar="RESULTS_DIR",
        help="folder written by simulations/run_experiments.py (holds manifest.json)",
    )


def run(args: argparse.Namespace) -> int:
    """Build the report and print its tables; 1 (with a message) on a bad folder."""
    from fedddl.report.build import build_report  # matplotlib is heavy: import on use only
    from fedddl.report.manifest import ManifestError
    from fedddl.report.tables import markdown_table

    try:
        report = build_report(args.results_dir)
    except ManifestError as exc:
        print(f"fedddl report: {exc}", file=sys.stderr)
        return 1
    for section in report.sections:
        print(f"## {section.title}\n")
        print(markdown_table(section.table))
        for note in section.notes:
            print(f"- {note}")
        print()
    print(f"wrote {report.markdown_path}, {report.csv_path} and "
          f"{len(report.figures)} figure(s) in {report.markdown_path.parent}")
    return 0
