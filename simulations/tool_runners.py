"""In-process calls of the real tools (``fedddl simulate`` / ``fedddl gossip``) for the driver.

Each runner takes one resolved variant configuration (kebab-case keys, as in
the experiment TOML, plus ``seed``) and returns the tool's JSON result dict,
exactly what the command line would write with ``--out``.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RUNNERS", "command_line", "gossip_fields", "run_gossip_config",
           "run_simulate_config", "run_simulate_inline", "shard_statistics", "timed_run"]

#: Keys of a simulate variant that are options of ``fedddl simulate``, not run-config keys.
_SIMULATE_FLAGS = {"num-clients": "--num-clients", "num-server-rounds": "--rounds",
                   "strategy": "--strategy", "partition": "--partition", "learning-rate": "--lr",
                   "dataset": "--dataset", "seed": "--seed", "data-root": "--data-root"}


def run_simulate_config(config: dict[str, Any]) -> dict[str, Any]:
    """Run one Flower simulation in-process; returns the ``fedddl simulate`` JSON dict."""
    from fedddl.flower.simulation import run

    run_config = {k: v for k, v in config.items() if k != "num-clients"}
    result: dict[str, Any] = run(run_config, num_clients=int(config["num-clients"]),
                                 progress=None)
    return result


def run_simulate_inline(config: dict[str, Any]) -> dict[str, Any]:
    """Run one simulation on the inline engine (no Ray); returns the same JSON dict.

    The same ServerApp and ClientApp as :func:`run_simulate_config`, every message handled
    at once, node after node, so replies come in a fixed order and a run replays exactly.
    The server waits for all ``num-clients`` nodes (``min-available-nodes``).
    """
    from fedddl.flower.simulation import run

    num_clients = int(config["num-clients"])
    run_config = {k: v for k, v in config.items() if k != "num-clients"}
    run_config["min-available-nodes"] = num_clients
    result: dict[str, Any] = run(run_config, num_clients=num_clients, engine="inline",
                                 progress=None)
    return result


#: TOML (command-line) names of gossip options whose config field is named differently.
_GOSSIP_FIELDS = {"max-virtual-time": "max_virtual_time_s"}


def gossip_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Kebab-case TOML keys -> :class:`fedddl.gossip.sim_config.GossipConfig` field names."""
    return {_GOSSIP_FIELDS.get(k, k.replace("-", "_")): v for k, v in config.items()
            if not (k == "data-root" and not v)}


def run_gossip_config(config: dict[str, Any]) -> dict[str, Any]:
    """Run one discrete-event gossip simulation; returns the ``fedddl gossip`` JSON dict."""
    from fedddl.gossip.sim_config import GossipConfig
    from fedddl.gossip.simulator import run_gossip

    result: dict[str, Any] = run_gossip(GossipConfig.from_mapping(gossip_fields(config)))
    return result


RUNNERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "simulate": run_simulate_config,
    "gossip": run_gossip_config,
    "simulate-inline": run_simulate_inline,
    "gossip-inline": run_gossip_config,
}


def timed_run(runner: Callable[[dict[str, Any]], dict[str, Any]],
              config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """``runner(config)`` and its run time, with one torch thread (runs share the cores)."""
    import time

    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    result = runner(config)
    return result, time.perf_counter() - start


def _simulate_options() -> set[str]:
    """Option strings of ``fedddl simulate`` (its shortcut flags)."""
    import argparse

    from fedddl.commands import simulate

    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


def _toml(value: Any) -> str:
    """A run-config value in Flower's ``--run-config`` syntax (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value + "'" if "'" not in value else '"' + value + '"'
    return repr(value)


def command_line(tool: str, config: dict[str, Any], out: Path) -> str:
    """The ``fedddl`` command line equivalent to running ``config`` with ``tool``.

    ``simulate`` keys without a shortcut flag go into one ``--run-config``; a gossip
    run without ``stop-at-target`` gets ``--continue-after-target`` (the driver records
    whole curves, the command stops at the target by default).
    """
    args = ["fedddl", tool]
    run_config: list[str] = []
    options = _simulate_options() if tool == "simulate" else set()
    for key, value in config.items():
        if key == "data-root" and not value:
            continue
        if tool == "gossip" and key == "stop-at-target":
            continue
        flag = _SIMULATE_FLAGS.get(key, f"--{key}") if tool == "simulate" else f"--{key}"
        if tool == "simulate" and (flag not in options or value is False):
            run_config.append(f"{key}={_toml(value)}")  # no flag (or no --no- switch)
        elif isinstance(value, bool):  # switches: --overlap / --no-overlap
            args.append(flag if value else f"--no-{flag[2:]}")
        else:
            args += [flag, str(value)]
    if run_config:
        args += ["--run-config", " ".join(run_config)]
    if tool == "gossip" and not config.get("stop-at-target", False):
        args.append("--continue-after-target")
    return shlex.join([*args, "--out", str(out)])


@cache
def _train_split(dataset: str, data_root: str) -> tuple[np.ndarray, np.ndarray]:
    """Labels and flattened features of a train split (cached: reused by every seed)."""
    from fedddl.data import as_tensors, load_dataset

    x, y = as_tensors(load_dataset(dataset, root=data_root or None, split="train"))
    return y.numpy(), x.reshape(x.shape[0], -1).numpy()


def shard_statistics(config: dict[str, Any]) -> dict[str, Any]:
    """``shard_report`` of the shards a simulate run with ``config`` trains on.

    Rebuilds the shards with :func:`fedddl.partition.make_shards` from the same
    dataset, method, client count, seed and Dirichlet alpha as the simulation.
    """
    from fedddl.partition import make_shards, shard_report

    labels, features = _train_split(str(config["dataset"]), str(config.get("data-root", "")))
    shards = make_shards(
        str(config.get("partition", "stratified")), labels, int(config["num-clients"]),
        seed=int(config["seed"]), alpha=float(config.get("dirichlet-alpha", 0.5)),
    )
    return shard_report(labels, shards, features)
