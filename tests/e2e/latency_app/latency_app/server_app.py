"""ServerApp of the latency probe: stock FedAvg, timestamps every round end."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from latency_app.model import make_data, make_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedAvg; write per-round wall-clock times and accuracy to results-path."""
    cfg = context.run_config
    rounds = int(cfg["num-server-rounds"])
    min_nodes = int(cfg["min-nodes"])
    poll = float(cfg["grid-poll-interval"])
    if poll > 0:
        from fedddl.flower.grid import FastPollGrid

        grid = FastPollGrid(grid, poll_interval_s=poll)
    x_test, y_test = make_data(seed=999, n=512)
    stamps: list[float] = []
    accuracies: list[float] = []

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        # Called before round 1 and after every round: its timestamps bound rounds.
        stamps.append(time.monotonic())
        model = make_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            acc = float((model(x_test).argmax(1) == y_test).float().mean())
        accuracies.append(acc)
        return MetricRecord({"accuracy": acc})

    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=1.0 if int(cfg["federated-evaluate"]) else 0.0,
        min_train_nodes=min_nodes,
        min_evaluate_nodes=min_nodes,
        min_available_nodes=min_nodes,
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(make_model().state_dict()),
        num_rounds=rounds,
        evaluate_fn=central_evaluate,
    )
    round_s = [b - a for a, b in itertools.pairwise(stamps)]
    results_path = str(cfg["results-path"])
    if results_path:
        Path(results_path).write_text(
            json.dumps({"round_seconds": round_s, "accuracy": accuracies}), encoding="utf-8"
        )
