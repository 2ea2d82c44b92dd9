"""Bytes a round and accuracy against the fraction of clients sampled, per strategy.

Runs ``--clients`` digits clients (stratified shards) for ``--rounds`` rounds at each
fraction of ``--fractions`` with TernGrad (``reternarize`` downlink), TernGrad (``grid``
downlink, one run per value of ``--grid-levels``), GradientAverage, FedAvg, and FedAvg
wrapped in ``TernaryDelta`` (its ternary-delta downlink, and its ``grid`` downlink per value
of ``--grid-levels``, by default and with ``assume_mod`` ("all mod"); clients with
``ternary_mod``: :mod:`simulations.ternary_delta_app`), on
the inline engine (:mod:`fedddl.flower.inline_grid`), every other setting at its default.
It prints per run the mean bytes up and down a round after round 5, their ratios to
FedAvg's at the same fraction (total and down), the final accuracy and the runtime. Every
run of a seed draws the same nodes (Flower's sampling uses :mod:`random`, seeded per run).

    python -m simulations.bench_participation
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

#: (label, strategy, downlink) of the runs at each fraction (grid runs are added per level).
_RUNS = (
    ("TernGrad (reternarize)", "terngrad", "reternarize"),
    ("GradientAverage", "gradient-average", "reternarize"),
    ("FedAvg", "fedavg", "reternarize"),
    ("TernaryDelta+FedAvg (delta)", "ternary-delta", "reternarize"),
)
_TERNARY_DELTA = {
    "ternary-delta": "simulations.ternary_delta_app:TernaryDeltaFedAvg",
    "ternary-delta-all-mod": "simulations.ternary_delta_app:TernaryDeltaFedAvgAllMod",
}
_SKIP = 5


def _run(
    strategy: str, downlink: str, fraction: float, args: argparse.Namespace, seed: int, levels: int
) -> dict[str, Any]:
    from clients.client_app import make_client_app
    from fedddl.app_config import AppConfig
    from fedddl.flower.inline_grid import InlineGrid
    from simulations.ternary_delta_app import make_delta_client_app
    from strategies.server_app import run_server

    delta = strategy in _TERNARY_DELTA
    cfg = AppConfig(
        dataset="digits",
        strategy=_TERNARY_DELTA.get(strategy, strategy),
        downlink=downlink,
        grid_levels=levels,
        num_server_rounds=args.rounds,
        fraction_train=fraction,
        min_available_nodes=args.clients,
        eval_every=args.rounds,
        seed=seed,
    )
    app = make_delta_client_app(cfg) if delta else make_client_app(cfg)
    grid = InlineGrid(app, args.clients)
    random.seed(seed)  # Flower samples nodes with the random module: the same draws per seed
    return run_server(grid, cfg, progress=lambda _: None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="rounds (default: 60)")
    parser.add_argument("--clients", type=int, default=100, help="clients (default: 100)")
    parser.add_argument(
        "--fractions", default="1.0,0.3,0.1,0.03", help="fractions (default: 1.0,0.3,0.1,0.03)"
    )
    parser.add_argument("--seeds", default="0", help="seeds, comma-separated (default: 0)")
    parser.add_argument(
        "--grid-levels", default="1", help="grid-levels of the grid runs (default: 1)"
    )
    parser.add_argument(
        "--only", default="", help="labels to run, comma-separated substrings (default: all)"
    )
    args = parser.parse_args(argv)
    if args.rounds <= _SKIP:
        parser.error(f"--rounds must exceed {_SKIP}")
    import torch

    torch.set_num_threads(1)
    fractions = [float(f) for f in args.fractions.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    levels = [int(v) for v in args.grid_levels.split(",")]
    runs = [(label, strategy, downlink, 1) for label, strategy, downlink in _RUNS]
    runs[1:1] = [(f"TernGrad (grid, L={v})", "terngrad", "grid", v) for v in levels]
    for v in levels:
        runs.append((f"TernaryDelta+FedAvg (grid, L={v})", "ternary-delta", "grid", v))
        runs.append((f"TernaryDelta+FedAvg (grid, L={v}, all mod)", "ternary-delta-all-mod",
                     "grid", v))  # fmt: skip
    if args.only:
        wanted = args.only.split(",")
        runs = [r for r in runs if any(w in r[0] for w in wanted) or r[0] == "FedAvg"]
    head = (
        f"{'fraction':>8}  {'strategy':<40} {'up B/rd':>10} {'down B/rd':>10} "
        f"{'total/FedAvg':>12} {'down/FedAvg':>11} {'accuracy':>8} {'time s':>7}"
    )
    print(f"{args.clients} clients, digits, {args.rounds} rounds, seeds {seeds}, inline engine;")
    print(f"bytes: mean a round after round {_SKIP}, over seeds\n")
    print(head)
    for fraction in fractions:
        rows: list[tuple[str, float, float, float, float]] = []
        for label, strategy, downlink, level in runs:
            up = down = accuracy = spent = 0.0
            for seed in seeds:
                start = time.perf_counter()
                result = _run(strategy, downlink, fraction, args, seed, level)
                spent += time.perf_counter() - start
                late = result["rounds"][_SKIP:]
                up += sum(r["bytes_up"] for r in late) / len(late) / len(seeds)
                down += sum(r["bytes_down"] for r in late) / len(late) / len(seeds)
                accuracy += result["summary"]["final_accuracy"] / len(seeds)
            rows.append((label, up, down, accuracy, spent))
        base = {label: (up, down) for label, up, down, _, _ in rows}["FedAvg"]
        for label, up, down, accuracy, spent in rows:
            total = (up + down) / (base[0] + base[1])
            print(
                f"{fraction:>8.2f}  {label:<40} {up:>10.0f} {down:>10.0f} {total:>12.3f} "
                f"{down / base[1]:>11.3f} {accuracy:>8.4f} {spent:>7.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
