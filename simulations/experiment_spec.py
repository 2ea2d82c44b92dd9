"""Experiment TOML files of ``simulations/experiments/``: loading and resolution.

A file describes one claim::

    [experiment]                 tool = "simulate" | "gossip", title, claim, target-accuracy,
                                 shard-statistics (record each run's shard report)
    [config]                     options shared by every variant (kebab-case)
    [quick]                      overrides applied by ``--quick`` (tiny, for tests)
    [datasets.<name>]            overrides applied when ``--dataset <name>`` is chosen
    [[links]]                    optional: name, bandwidth-Bps, latency-s (simulated time)
    [[variants]]                 label, optional group, and overrides of [config]
    [matrix]                     optional: lists of values; every variant runs in every
                                 combination (its group), named by the ``group`` template

A matrix ``num-clients = [50, 100]``, ``local-steps = [1, 20]``,
``group = "{num-clients} workers, {local-steps} local steps"`` turns each variant into four,
one per combination, in groups named from the template (``{key}`` is replaced by the value;
a list item may be a table that sets several keys at once,
``{name = "clean", attack = "", num-attackers = 0}``, named by its ``name``).
``[datasets.<name>.matrix]`` and ``[quick.matrix]`` replace the matrix for that dataset or
``--quick``. Variants of a matrix experiment have no group of their own.

Overrides apply in the order config < dataset < quick < matrix < variant, so a variant's
defining key (its strategy, partition or scheduler) always wins. ``target-accuracy`` goes
to the gossip tool (which measures time-to-target itself), not to simulate's run config
(the report applies it to the recorded curve).
"""

from __future__ import annotations

import itertools
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
    shard_statistics: bool = False


def _table(doc: dict[str, Any], key: str, where: Path) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{where}: [{key}] must be a table")
    return dict(value)


def _matrix(table: dict[str, Any], where: Path) -> list[tuple[str, dict[str, Any]]]:
    """``[matrix]`` -> ``[(group name, overrides), ...]`` in the product's order."""
    table = dict(table)
    template = table.pop("group", None)
    if not table:
        return []
    if not isinstance(template, str) or not template:
        raise ValueError(f"{where}: [matrix] needs a group template, e.g. "
                         f"group = \"{' '.join('{' + k + '}' for k in table)}\"")
    for key, values in table.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}: [matrix] {key} must be a non-empty list, got {values!r}")
        for value in values:
            if isinstance(value, dict) and not isinstance(value.get("name"), str):
                raise ValueError(f"{where}: [matrix] {key}: a table in the list needs a "
                                 f"name (used in the group template), got {value!r}")
    groups = []
    for combo in itertools.product(*table.values()):
        overrides: dict[str, Any] = {}
        name = template
        for key, value in zip(table, combo, strict=True):
            if isinstance(value, dict):  # several keys at once, named by its name
                overrides.update({k: v for k, v in value.items() if k != "name"})
                value = value["name"]
            else:
                overrides[key] = value
            name = name.replace("{" + key + "}", str(value))
        groups.append((name, overrides))
    if len({name for name, _ in groups}) != len(groups):
        raise ValueError(f"{where}: [matrix] group template {template!r} gives the same name "
                         "to different combinations; name every key in it")
    return groups


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
    matrix = _table(doc, "matrix", path)
    layers = [_table(_table(doc, "datasets", path), dataset, path)]
    if quick:
        layers.append(_table(doc, "quick", path))
    for overrides in layers:  # each may replace the matrix as well as keys
        if "matrix" in overrides:
            matrix = _table(overrides, "matrix", path)
            del overrides["matrix"]
        base.update(overrides)
    target = float(base.pop("target-accuracy", meta.get("target-accuracy", 0.9)))
    if not 0.0 < target <= 1.0:
        raise ValueError(f"{path}: target-accuracy must be in (0, 1], got {target}")
    if tool == "gossip":  # the gossip tool measures time-to-target itself
        base["target-accuracy"] = target
    variants = []
    raw_variants = doc.get("variants", [])
    if not isinstance(raw_variants, list) or not raw_variants:
        raise ValueError(f"{path}: needs at least one [[variants]] entry")
    groups = _matrix(matrix, path)
    for entry in raw_variants:
        entry = dict(entry)
        label = entry.pop("label", None)
        if not isinstance(label, str) or not label:
            raise ValueError(f"{path}: every [[variants]] entry needs a non-empty label")
        group = str(entry.pop("group", ""))
        if groups and group:
            raise ValueError(f"{path}: variant {label!r} has a group, but [matrix] names "
                             "the groups")
        if not groups:
            variants.append(VariantSpec(label, group, {**base, **entry}))
    for group_name, cell in groups:  # group by group: its variants run side by side
        for entry in raw_variants:
            entry = dict(entry)
            label = entry.pop("label")
            variants.append(VariantSpec(label, group_name, {**base, **cell, **entry}))
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
        shard_statistics=bool(meta.get("shard-statistics", False)),
    )
