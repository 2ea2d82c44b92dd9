"""Seconds a round and process peak memory against the size of the federation.

Runs TernGrad (``grid`` downlink) on digits with the inline engine
(:mod:`fedddl.flower.inline_grid`; ``random`` shards, as 1,000 stratified digits shards do
not exist) at each ``clients:fraction`` pair of ``--configs``, each in a fresh subprocess,
every other setting at its default (evaluation only after the last round). It prints per run
the mean replies accepted a round, the nodes whose client state is not empty at the end, the
nodes the server's per-node structures hold (``NodeBook``, ``ResyncLimiter``), the median
seconds a round (round 1 excluded), the mean bytes down a round (round 1 excluded) and the
process' peak RSS: the inline engine runs the clients in the server's process, so that
figure is server and inline clients together. ``--engine ray`` runs Flower's Ray simulation
instead: the clients run in Ray actors, the RSS is the driver's (server and Ray driver) and
client state is not counted.

    python -m simulations.bench_scale
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

_CONFIGS = "100:0.05,1000:0.005,1000:0.01,1000:0.05"


def _child(clients: int, fraction: float, rounds: int, seed: int, engine: str) -> dict[str, Any]:
    """One run in this process; returns its measurements."""
    import torch

    from clients.client_app import make_client_app
    from fedddl.app_config import AppConfig
    from fedddl.flower.inline_grid import InlineGrid
    from fedddl.flower.simulation import run
    from fedddl.sync.nodes import NodeBook
    from fedddl.sync.resync_limit import ResyncLimiter
    from strategies.server_app import run_server

    torch.set_num_threads(1)
    cfg = AppConfig(
        dataset="digits",
        strategy="terngrad",
        downlink="grid",
        partition="random",
        num_server_rounds=rounds,
        fraction_train=fraction,
        min_available_nodes=clients,
        eval_every=rounds,
        seed=seed,
    )
    start = time.perf_counter()
    grid = None
    if engine == "inline":
        grid = InlineGrid(make_client_app(cfg), clients)
        result = run_server(grid, cfg, progress=lambda _: None)
    else:
        result = run(cfg, num_clients=clients, engine="ray", progress=None)
    spent = time.perf_counter() - start
    rows = result["rounds"]
    late = rows[1:] or rows
    known: set[int] = set()
    for held in gc.get_objects():
        if isinstance(held, NodeBook):
            known |= set(held.version) | set(held.compressor)
        elif isinstance(held, ResyncLimiter):
            known |= held.needing | set(held.last_served) | set(held.strikes)
    trained = None if grid is None else sum(1 for c in grid.contexts.values() if c.state)
    return {
        "clients": clients,
        "fraction": fraction,
        "accepted": statistics.mean(r.get("accepted", 0) for r in rows),
        "trained_nodes": trained,
        "server_known_nodes": len(known),
        "s_per_round": statistics.median(r["wall_s"] for r in late),
        "bytes_down": sum(r["bytes_down"] for r in late) / len(late),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "runtime_s": spent,
    }


def _spawn(clients: int, fraction: float, rounds: int, seed: int, engine: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "simulations.bench_scale", "--child"]
    argv += [f"{clients}:{fraction}", "--rounds", str(rounds), "--seed", str(seed)]
    argv += ["--engine", engine]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    parsed: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return parsed


def _pair(text: str) -> tuple[int, float]:
    clients, fraction = text.split(":")
    return int(clients), float(fraction)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds (default: 20)")
    parser.add_argument(
        "--configs", default=_CONFIGS, help=f"clients:fraction pairs (default: {_CONFIGS})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument(
        "--engine", default="inline", choices=("inline", "ray"), help="engine (default: inline)"
    )
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    if args.child:
        print(json.dumps(_child(*_pair(args.child), args.rounds, args.seed, args.engine)))
        return 0
    print(f"TernGrad (grid), digits, {args.rounds} rounds, seed {args.seed}, {args.engine} engine;")
    who = "server + inline clients" if args.engine == "inline" else "server, Ray driver"
    print(f"s/round: median after round 1; peak RSS: process ({who})\n")
    print(
        f"{'clients':>7} {'fraction':>8} {'replies':>7} {'trained':>7} {'known':>5} {'s/round':>8} "
        f"{'down B/rd':>10} {'peak RSS MiB':>12} {'time s':>7}"
    )
    for text in args.configs.split(","):
        row = _spawn(*_pair(text), args.rounds, args.seed, args.engine)
        print(
            f"{row['clients']:>7} {row['fraction']:>8.3f} {row['accepted']:>7.1f} "
            f"{row['trained_nodes'] if row['trained_nodes'] is not None else '-':>7} "
            f"{row['server_known_nodes']:>5} "
            f"{row['s_per_round']:>8.4f} {row['bytes_down']:>10.0f} "
            f"{row['peak_rss_mib']:>12.1f} {row['runtime_s']:>7.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
