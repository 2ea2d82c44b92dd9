"""The results-folder manifest shared by the experiment driver and ``fedddl report``.

A results folder holds one ``manifest.json`` and the raw JSON of every run::

    RESULTS_DIR/
      manifest.json
      sharding/<variant>/seed<S>.json          # ``fedddl simulate`` output
      sharding/<variant>/seed<S>.shards.json   # ``shard_report`` of that run's shards
      ternary/<variant>/seed<S>.json
      gossip/<variant>/seed<S>.json            # ``fedddl gossip`` output

``manifest.json``::

    {"format": "fedddl-results/1", "dataset": "digits", "seeds": [0, 1, 2],
     "quick": false, "hardware": "...", "command": "python simulations/...",
     "experiments": {
       "<name>": {"tool": "simulate" | "gossip", "title": str, "claim": str,
                  "target_accuracy": float, "runtime_s": float, "seeds": [int],
                  "command": str, "commands": [str] (optional: several runs into one folder),
                  "links": [{"name", "bandwidth_Bps", "latency_s"}],   # optional
                  "variants": [{"label": str, "group": str (optional),
                                "config": {...},
                                "runs": [{"seed": int, "result": "rel/path.json",
                                          "shards": "rel/path.json" (optional),
                                          "runtime_s": float}]}]}}}

Paths are relative to the results folder so that the folder can be moved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "TOOLS",
    "ManifestError",
    "load_json",
    "load_manifest",
    "write_manifest",
]

FORMAT = "fedddl-results/1"
MANIFEST_NAME = "manifest.json"
TOOLS: tuple[str, ...] = ("simulate", "gossip")


class ManifestError(ValueError):
    """A results folder or its manifest is missing or malformed."""


def load_json(path: Path) -> Any:
    """Read one JSON file, naming the file in any error.

    Raises
    ------
    ManifestError
        If the file is missing or is not valid JSON.
    """
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ManifestError(f"missing result file {path}") from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path} is not valid JSON: {exc}") from exc


def _require(mapping: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in mapping:
        raise ManifestError(f"{where}: missing key {key!r}")
    value = mapping[key]
    if not isinstance(value, kind):
        raise ManifestError(f"{where}: {key!r} has type {type(value).__name__}")
    return value


def load_manifest(results_dir: Path) -> dict[str, Any]:
    """Load and check ``RESULTS_DIR/manifest.json``.

    Checks the structure only; run files are read by the report itself.

    Raises
    ------
    ManifestError
        If the folder or manifest is missing, or the manifest is malformed.
    """
    if not results_dir.is_dir():
        raise ManifestError(f"results folder {results_dir} does not exist")
    manifest = load_json(results_dir / MANIFEST_NAME)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(f"{results_dir / MANIFEST_NAME} is not a {FORMAT} manifest")
    experiments = _require(manifest, "experiments", dict, "manifest")
    for name, exp in experiments.items():
        where = f"experiment {name!r}"
        if not isinstance(exp, dict):
            raise ManifestError(f"{where} is not an object")
        tool = _require(exp, "tool", str, where)
        if tool not in TOOLS:
            raise ManifestError(f"{where}: unknown tool {tool!r}")
        _require(exp, "target_accuracy", (int, float), where)
        for variant in _require(exp, "variants", list, where):
            vwhere = f"{where} variant {variant.get('label')!r}"
            _require(variant, "label", str, vwhere)
            for run in _require(variant, "runs", list, vwhere):
                _require(run, "seed", int, vwhere)
                _require(run, "result", str, vwhere)
    return manifest


def write_manifest(results_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest`` (adding the format tag) atomically to ``RESULTS_DIR/manifest.json``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **manifest}, indent=2, sort_keys=False))
    tmp.replace(path)  # a crash mid-write never leaves a half manifest behind
    return path
