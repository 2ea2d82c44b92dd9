"""Experiment TOML files of ``simulations/experiments/``: loading and resolution.

A file describes one claim::

    [experiment]                 tool = "simulate" | "gossip", title, claim, target-accuracy
    [config]                     options shared by every variant (kebab-case)
    [quick]                      overrides applied by ``--quick`` (tiny, for tests)
    [datasets.<name>]            overrides applied when ``--dataset <name>`` is chosen
    [[links]]                    optional: name, bandwidth-Bps, latency-s (simulated time)
    [[variants]]                 label, optional group, and overrides of [config]

``target-accuracy`` may be overridden in ``[quick]`` / ``[datasets.<name>]`` too; it
is passed on to the gossip tool (which measures time-to-target itself) and kept
out of simulate's run config (the report applies it to the recorded curve).
Overrides are applied in the order config < dataset < quick < variant, so a
variant's defining key (its strategy, partition or scheduler) always wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

__all__ = ["EXPERIMENTS_DIR", "ExperimentSpec", "VariantSpec", "load_experiment"]

EXPERIMENTS_DIR = Path(__file__).resolve().parent / "experiments"
_TOOLS = ("simulate", "gossip")


@dataclass(frozen=True)
class VariantSpec:
    """One configuration of an experiment (run once per seed)."""

    label: str
    group: str
    config: dict[str, Any]


@dataclass(frozen=True)
class ExperimentSpec:
    """A resolved experiment: every variant's full configuration for one dataset."""

    name: str
    tool: str
    title: str
    claim: str
    target_accuracy: float
    dataset: str
    variants: list[VariantSpec]
    links: list[dict[str, Any]] = field(default_factory=list)
    source: Path | None = None


def _table(doc: dict[str, Any], key: str, where: Path) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{where}: [{key}] must be a table")
    return dict(value)


def load_experiment(
    name: str,
    *,
    dataset: str = "digits",
    quick: bool = False,
    data_root: str | None = None,
    directory: Path = EXPERIMENTS_DIR,
) -> ExperimentSpec:
    """Load ``<directory>/<name>.toml`` and resolve it for ``dataset``.

    Parameters
    ----------
    name : str
        Experiment name (file stem).
    dataset : str
        Dataset every variant runs on (``[datasets.<dataset>]`` overrides apply).
    quick : bool
        Apply the ``[quick]`` overrides.
    data_root : str, optional
        Data directory passed to the tools as ``data-root``.
    directory : Path
        Where the TOML files are.

    Returns
    -------
    ExperimentSpec

    Raises
    ------
    ValueError
        If the file is missing or malformed (the message names the file and key).
    """
    path = directory / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.toml")))
        raise ValueError(f"no experiment {name!r} in {directory} (known: {known})")
    with path.open("rb") as handle:
        doc = tomllib.load(handle)
    meta = _table(doc, "experiment", path)
    tool = meta.get("tool")
    if tool not in _TOOLS:
        raise ValueError(f"{path}: [experiment] tool must be one of {_TOOLS}, got {tool!r}")
    base = _table(doc, "config", path)
    base["dataset"] = dataset
    if data_root:
        base["data-root"] = data_root
    base.update(_table(_table(doc, "datasets", path), dataset, path))
    if quick:
        base.update(_table(doc, "quick", path))
    target = float(base.pop("target-accuracy", meta.get("target-accuracy", 0.9)))
    if not 0.0 < target <= 1.0:
        raise ValueError(f"{path}: target-accuracy must be in (0, 1], got {target}")
    if tool == "gossip":  # the gossip tool measures time-to-target itself
        base["target-accuracy"] = target
    variants = []
    raw_variants = doc.get("variants", [])
    if not isinstance(raw_variants, list) or not raw_variants:
        raise ValueError(f"{path}: needs at least one [[variants]] entry")
    for entry in raw_variants:
        entry = dict(entry)
        label = entry.pop("label", None)
        if not isinstance(label, str) or not label:
            raise ValueError(f"{path}: every [[variants]] entry needs a non-empty label")
        group = str(entry.pop("group", ""))
        variants.append(VariantSpec(label, group, {**base, **entry}))
    keys = [(v.group, v.label) for v in variants]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: duplicate (group, label) among [[variants]]")
    links = [
        {"name": str(d["name"]), "bandwidth_Bps": float(d["bandwidth-Bps"]),
         "latency_s": float(d["latency-s"])}
        for d in doc.get("links", [])
    ]
    return ExperimentSpec(
        name=name,
        tool=str(tool),
        title=str(meta.get("title", name)),
        claim=str(meta.get("claim", "")),
        target_accuracy=target,
        dataset=dataset,
        variants=variants,
        links=links,
        source=path,
    )
