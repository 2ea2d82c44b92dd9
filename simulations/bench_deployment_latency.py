"""Round latency of a real loopback Flower deployment: stock settings vs. tuned.

Starts a SuperLink and N SuperNodes as separate processes on 127.0.0.1 for
every configuration, runs the tiny FedAvg app in ``tests/e2e/latency_app``
(64-32-10 MLP, one SGD step per node per round) through ``flwr run``, reads
the per-round wall-clock times the ServerApp measured, stops everything and
prints a table. Each configuration adds one change to the previous one:

* ``stock``            Flower 1.42 defaults (SuperExec polls tasks every 1 s,
                       SuperNode polls messages every 3 s, ServerApp grid polls
                       replies every 3 s, train + evaluate message per round);
* ``+superexec-poll``  ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1`` (Flower's env variable);
* ``+grid-poll``       ServerApp wraps its grid in ``FastPollGrid`` (50 ms pulls);
* ``+supernode-poll``  SuperNodes run via ``fedddl.flower.fast_supernode`` (0.2 s);
* ``+train-only``      no separate evaluate message (one message per node per round;
                       evaluate centrally or piggy-back metrics on the train reply);
* ``+warm-clientapp``  ClientApp processes fork from a per-SuperNode server that
                       imported flwr + torch once (``fedddl.deploy.warm_clientapp``).

``--repeat N`` cycles through the settings N times (interleaved, so a change in
machine load hits every setting alike) and pools the rounds.

Usage::

    python -m simulations.bench_deployment_latency --rounds 3 --supernodes 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fedddl.deploy.processes import (
    FAST_SUPEREXEC_POLL_INTERVAL_S,
    FAST_SUPERNODE_POLL_INTERVAL_S,
    ProcessRegistry,
    flower_env,
    run_flwr,
    start_superlink,
    start_supernode,
    write_flwr_config,
)

APP_DIR = Path(__file__).resolve().parents[1] / "tests" / "e2e" / "latency_app"


@dataclass(frozen=True)
class Setting:
    """One benchmarked configuration."""

    name: str
    superexec_poll_s: float | None
    grid_poll_s: float
    supernode_poll_s: float | None
    federated_evaluate: bool
    warm_clientapp: bool = False


SETTINGS = (
    Setting("stock", None, 0.0, None, True),
    Setting("+superexec-poll", FAST_SUPEREXEC_POLL_INTERVAL_S, 0.0, None, True),
    Setting("+grid-poll", FAST_SUPEREXEC_POLL_INTERVAL_S, 0.05, None, True),
    Setting("+supernode-poll", FAST_SUPEREXEC_POLL_INTERVAL_S, 0.05,
            FAST_SUPERNODE_POLL_INTERVAL_S, True),
    Setting("+train-only", FAST_SUPEREXEC_POLL_INTERVAL_S, 0.05,
            FAST_SUPERNODE_POLL_INTERVAL_S, False),
    Setting("+warm-clientapp", FAST_SUPEREXEC_POLL_INTERVAL_S, 0.05,
            FAST_SUPERNODE_POLL_INTERVAL_S, False, True),
)


def run_setting(setting: Setting, rounds: int, supernodes: int, workdir: Path) -> dict[str, object]:
    """Deploy, run ``rounds`` rounds, tear down; return the measured round times."""
    workdir.mkdir(parents=True)
    home = workdir / "flwr_home"
    env = flower_env(home, superexec_poll_interval_s=setting.superexec_poll_s)
    registry = ProcessRegistry()
    try:
        superlink = registry.add(start_superlink(workdir, env=env))
        for i in range(supernodes):
            registry.add(start_supernode(
                f"supernode-{i}", superlink.address, workdir, env=env,
                node_config={"partition-id": i, "num-partitions": supernodes},
                poll_interval_s=setting.supernode_poll_s,
                warm_clientapp_preload=["torch"] if setting.warm_clientapp else None,
            ))
        write_flwr_config(home, {"bench": superlink.address})
        results = workdir / "results.json"
        run_config = (
            f"num-server-rounds={rounds} min-nodes={supernodes} "
            f"federated-evaluate={int(setting.federated_evaluate)} "
            f"grid-poll-interval={setting.grid_poll_s} results-path=\"{results}\""
        )
        started = time.monotonic()
        outcome = run_flwr(["run", str(APP_DIR), "bench", "--stream", "--run-config", run_config],
                           env=env, timeout_s=120 + 90 * rounds)
        total = time.monotonic() - started
        if outcome.returncode != 0 or not results.exists():
            raise RuntimeError(f"{setting.name}: flwr run failed:\n{outcome.stdout[-3000:]}")
        measured = json.loads(results.read_text())
        return {"setting": setting.name, "round_seconds": measured["round_seconds"],
                "accuracy": measured["accuracy"], "flwr_run_seconds": total}
    finally:
        registry.stop_all()


def main(argv: list[str] | None = None) -> int:
    """Run the selected settings and print the table (optionally save JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--supernodes", type=int, default=2)
    parser.add_argument("--settings", default=",".join(s.name for s in SETTINGS),
                        help="comma-separated subset of: " + ", ".join(s.name for s in SETTINGS))
    parser.add_argument("--repeat", type=int, default=1,
                        help="cycle through the settings this many times (interleaved)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    chosen = [s for s in SETTINGS if s.name in args.settings.split(",")]
    if not chosen:
        parser.error("no known setting selected")

    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="fedddl-bench-") as tmp:
        for repetition in range(args.repeat):
            for setting in chosen:
                load_before = os.getloadavg()[0]
                workdir = Path(tmp) / f"{setting.name}-{repetition}"
                run = run_setting(setting, args.rounds, args.supernodes, workdir)
                run["load_avg_1min"] = load_before
                runs.append(run)
                print(f"done {setting.name}: {run['round_seconds']} (load {load_before:.1f})",
                      file=sys.stderr, flush=True)
    rows = []
    for setting in chosen:
        mine = [r for r in runs if r["setting"] == setting.name]
        rows.append({
            "setting": setting.name,
            "round_seconds": [t for r in mine for t in r["round_seconds"]],  # type: ignore[attr-defined]
            "accuracy": mine[-1]["accuracy"],
            "load_avg_1min": round(statistics.mean(float(r["load_avg_1min"]) for r in mine), 1),  # type: ignore[arg-type]
        })

    print(f"\nloopback deployment, {args.supernodes} SuperNodes, {args.rounds} rounds x "
          f"{args.repeat} repeats, {os.cpu_count()} CPUs")
    header = f"{'setting':<17} {'mean s/round':>12} {'median':>8} {'min':>7} {'max':>7} " \
             f"{'load':>5} {'final acc':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        times = [float(t) for t in row["round_seconds"]]  # type: ignore[attr-defined]
        acc = row["accuracy"][-1]  # type: ignore[index]
        print(f"{row['setting']:<17} {statistics.mean(times):>12.2f} "
              f"{statistics.median(times):>8.2f} {min(times):>7.2f} {max(times):>7.2f} "
              f"{row['load_avg_1min']:>5} {acc:>9.3f}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
