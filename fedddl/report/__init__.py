"""Experiment reports: the results-folder manifest, statistics over seeds, tables, plots.

* :mod:`fedddl.report.manifest`: the manifest shared by the experiment driver and
  ``fedddl report``;
* :mod:`fedddl.report.stats`: per-round arrays, bands over seeds, rounds/time to a target
  (pure numpy on the JSON results);
* :mod:`fedddl.report.tables`: Markdown and CSV tables;
* :mod:`fedddl.report.plots`: matplotlib figures;
* :mod:`fedddl.report.build`: :func:`~fedddl.report.build.build_report`, the whole report
  of a results folder (what ``fedddl report RESULTS_DIR`` runs).

Submodules are imported on use (matplotlib is heavy).
"""

from typing import Any

__all__ = ["build_report"]


def __getattr__(name: str) -> Any:
    """``fedddl.report.build_report`` imports :mod:`fedddl.report.build` on first use."""
    if name == "build_report":
        from fedddl.report.build import build_report

        return build_report
    raise AttributeError(f"module 'fedddl.report' has no attribute {name!r}")
