"""The fedddl ServerApp: builds the strategy, runs it, evaluates, writes the results JSON.

``app`` (used by ``flwr run``) reads its :class:`~fedddl.app_config.AppConfig`
from ``context.run_config``; :func:`make_server_app` binds a given config and a
``sink`` that receives the results dict (the in-process ``fedddl simulate`` path).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedddl.app_config import AppConfig

__all__ = ["app", "make_server_app", "run_server", "summarize"]


def run_server(
    grid: Grid, cfg: AppConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run ``cfg.num_server_rounds`` rounds on ``grid`` and return the results dict.

    Returns
    -------
    dict
        ``{"config", "initial", "rounds": [{"round", "accuracy", "loss", "bytes_up",
        "bytes_down", "replicas_equal", "wall_s", ...}], "final_accuracy", "summary"}``.
    """
    from clients.localized import model_factory
    from fedddl.data import as_tensors, load_dataset
    from strategies.counting_grid import CountingGrid
    from strategies.recorder import RoundRecorder
    from strategies.registry import build_strategy

    cfg.import_plugins()
    model_fn = model_factory(cfg)
    strategy = build_strategy(cfg, model_fn)
    x_test, y_test = as_tensors(load_dataset(cfg.dataset, cfg.data_root or None, split="test"))
    counting = CountingGrid(grid)
    recorder = RoundRecorder(
        model_fn, x_test, y_test, counting, strategy, cfg.num_server_rounds, progress
    )
    shadow = getattr(strategy, "shadow", None)
    initial = shadow.model if shadow is not None else model_fn()
    start = time.perf_counter()
    strategy.start(
        grid=counting,
        initial_arrays=ArrayRecord(initial.state_dict()),
        num_rounds=cfg.num_server_rounds,
        evaluate_fn=recorder,
    )
    total = time.perf_counter() - start
    config = cfg.to_run_config()
    config["num-clients"] = len(list(grid.get_node_ids()))
    config["strategy-class"] = f"{type(strategy).__module__}.{type(strategy).__qualname__}"
    result: dict[str, Any] = {
        "config": config,
        "initial": recorder.initial,
        "rounds": recorder.rounds,
        "final_accuracy": recorder.rounds[-1]["accuracy"] if recorder.rounds else None,
        "total_s": total,
    }
    result["summary"] = summarize(result)
    log(INFO, "fedddl summary: %s", json.dumps(result["summary"]))
    if cfg.results_path:
        path = Path(cfg.results_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        log(INFO, "fedddl results written to %s", path)
    return result


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Return means of bytes and wall time per round, final accuracy and replica agreement."""
    rounds = result["rounds"]
    if not rounds:
        return {}
    n = len(rounds)
    checked = [r["replicas_equal"] for r in rounds if r["replicas_equal"] is not None]
    return {
        "rounds": n,
        "final_accuracy": rounds[-1]["accuracy"],
        "best_accuracy": max(r["accuracy"] for r in rounds),
        "mean_bytes_up": sum(r["bytes_up"] for r in rounds) / n,
        "mean_bytes_down": sum(r["bytes_down"] for r in rounds) / n,
        "mean_wall_s": sum(r["wall_s"] for r in rounds) / n,
        "mean_wall_s_after_first": (
            sum(r["wall_s"] for r in rounds[1:]) / (n - 1) if n > 1 else rounds[0]["wall_s"]
        ),
        "replicas_equal_all": all(checked) if checked else None,
        "dropped_replies": sum(len(r.get("dropped", {})) for r in rounds),
    }


def make_server_app(
    cfg: AppConfig | None = None,
    sink: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ServerApp:
    """Build a ServerApp bound to ``cfg`` (None: read ``context.run_config``)."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        if cfg is None and context.run_config.get("strategy") == "gossip":
            # Gossip mode: the server only coordinates; models travel peer to peer.
            from strategies.gossip_coordinator import GossipConfig, run_gossip

            gossip = run_gossip(grid, context, GossipConfig.from_run_config(context.run_config))
            if sink is not None:
                sink(dataclasses.asdict(gossip))
            return
        run_cfg = cfg if cfg is not None else AppConfig.from_run_config(context.run_config)
        result = run_server(grid, run_cfg, progress)
        if sink is not None:
            sink(result)

    return server


app = make_server_app()
