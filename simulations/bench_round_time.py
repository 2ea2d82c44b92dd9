"""Wall time of a simulated round: TernGrad against FedAvg (and GradientAverage), side by side.

Runs the same configuration with each strategy through ``fedddl simulate``'s Python API
(Flower's Ray simulation, one actor per ``--cpus-per-client`` CPUs), each run in a fresh
Python process (runs are independent samples: nothing a run leaves in the process, Ray's
or ours, weighs on the next), ``--repeats`` times, alternating which strategy goes first,
and prints each run's median round (the first round, which pays Ray's start-up, is left
out), its median exchange (the server's messages out to the last reply in: the clients'
work and Flower's and Ray's hops), its final accuracy and its mean bytes per round, then
the median over runs and the ratios to FedAvg and to GradientAverage (same seed, same
shards), where the round went (exchange against the rest: the server's work on the
round), and, run by run, the ratio of TernGrad's median to the other strategy's in the
same repeat.

    python simulations/bench_round_time.py --dataset digits --rounds 40
    python simulations/bench_round_time.py --dataset fashion-mnist --arch resnet8 --rounds 100 \
        --repeats 1 --eval-samples 2000

The last lines read ``bytes per round (up + down): terngrad A B, ...``, ``median round:
terngrad A s, fedavg B s, gradient-average C s (terngrad/fedavg R, terngrad/gradient-average
Q)``, ``median exchange: terngrad A s, ...; rest of the round: terngrad B s, ...`` and
``per repeat terngrad/fedavg: r1 r2 ... (TernGrad no slower in K of N)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

STRATEGIES = ("terngrad", "fedavg", "gradient-average")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="dataset name (default: digits)")
    parser.add_argument("--arch", default="", help="model architecture (default: the dataset's)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds per run (default: 40)")
    parser.add_argument("--num-clients", type=int, default=10, help="clients (default: 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per strategy (default: 3)")
    parser.add_argument("--cpus-per-client", type=float, default=1.0,
                        help="Ray CPUs per client (default: 1, one actor per core)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every N rounds (default: 0, only the last round)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated subset to run (default: all three)")
    parser.add_argument("--eval-samples", type=int, default=0,
                        help="test samples per evaluation (default: 0, all)")
    parser.add_argument("--one-run", help=argparse.SUPPRESS)  # the child of one run
    args = parser.parse_args(argv)
    if args.one_run is not None:
        return _one_run(args, args.one_run)
    chosen = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(chosen) - set(STRATEGIES))
    if unknown or "terngrad" not in chosen or len(chosen) < 2:
        parser.error(f"--strategies: terngrad and at least one of {STRATEGIES[1:]} "
                     f"(unknown: {unknown})")

    medians: dict[str, list[float]] = {s: [] for s in chosen}
    exchanges: dict[str, list[float]] = {s: [] for s in chosen}
    traffic: dict[str, list[float]] = {s: [] for s in chosen}
    for repeat in range(args.repeats):
        order = chosen if repeat % 2 == 0 else chosen[::-1]
        for strategy in order:
            start = time.perf_counter()
            result = _run_in_fresh_process(argv, strategy)
            walls = result["walls"]
            medians[strategy].append(statistics.median(walls))
            exchanges[strategy].append(statistics.median(result["exchanges"]))
            traffic[strategy].append(result["bytes"])
            took = time.perf_counter() - start
            print(
                f"run {repeat + 1} {strategy:16s} median round {medians[strategy][-1]:.3f} s "
                f"(min {min(walls):.3f}, max {max(walls):.3f}; "
                f"exchange {exchanges[strategy][-1]:.3f} s; run {took:.0f} s, "
                f"accuracy {result['final_accuracy']:.4f}, "
                f"{traffic[strategy][-1]:,.0f} B/round up + down)",
                flush=True,
            )
            curve = result["curve"]
            if len(curve) > 1:
                print("    accuracy by round: " + ", ".join(f"{n} {a:.4f}" for n, a in curve))
    overall = {s: statistics.median(v) for s, v in medians.items()}
    volume = {s: statistics.median(v) for s, v in traffic.items()}
    others = [s for s in chosen if s != "terngrad"]
    print(
        "bytes per round (up + down): "
        + ", ".join(f"{s} {volume[s]:,.0f}" for s in chosen)
        + " ("
        + ", ".join(f"{s}/terngrad {volume[s] / volume['terngrad']:.1f}x" for s in others)
        + ")"
    )
    print(
        "median round: "
        + ", ".join(f"{s} {overall[s]:.3f} s" for s in chosen)
        + " ("
        + ", ".join(f"terngrad/{s} {overall['terngrad'] / overall[s]:.2f}" for s in others)
        + ")"
    )
    rest = {s: statistics.median(m - e for m, e in zip(medians[s], exchanges[s], strict=True))
            for s in chosen}
    print(
        "median exchange: "
        + ", ".join(f"{s} {statistics.median(exchanges[s]):.4f} s" for s in chosen)
        + "; rest of the round: "
        + ", ".join(f"{s} {rest[s]:.4f} s" for s in chosen)
    )
    for other in others:
        pairs = [t / o for t, o in zip(medians["terngrad"], medians[other], strict=True)]
        print(
            f"per repeat terngrad/{other}: " + " ".join(f"{r:.2f}" for r in pairs)
            + f" (TernGrad no slower in {sum(r <= 1.0 for r in pairs)} of {len(pairs)})"
        )
    return 0


def _run_in_fresh_process(argv: list[str] | None, strategy: str) -> dict[str, Any]:
    """One run of ``strategy`` in a new Python process (this script with the same options
    and ``--one-run``); its round walls and exchanges, accuracy, bytes and accuracy curve."""
    options = sys.argv[1:] if argv is None else argv
    done = subprocess.run(
        [sys.executable, __file__, *options, "--one-run", strategy],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"the {strategy} run failed (exit status {done.returncode})")
    result: dict[str, Any] = json.loads(lines[-1][len(_RESULT) :])
    return result


_RESULT = "BENCH-RESULT "


def _one_run(args: argparse.Namespace, strategy: str) -> int:
    """The child side of :func:`_run_in_fresh_process`: run, print one result line."""
    from fedddl.app_config import AppConfig
    from fedddl.flower.simulation import run

    cfg = AppConfig(
        num_server_rounds=args.rounds,
        strategy=strategy,
        dataset=args.dataset,
        arch=args.arch,
        eval_every=args.eval_every or args.rounds,
        eval_samples=args.eval_samples,
    )
    result = run(cfg, num_clients=args.num_clients,
                 num_cpus_per_client=args.cpus_per_client, progress=None)
    rounds = result["rounds"]
    summary = result["summary"]
    out = {
        "walls": [r["wall_s"] for r in rounds[1:]],
        "exchanges": [r["exchange_s"] for r in rounds[1:]],
        "final_accuracy": result["final_accuracy"],
        "bytes": summary["mean_bytes_up"] + summary["mean_bytes_down"],
        "curve": [(r["round"], r["accuracy"]) for r in rounds if r["accuracy"] is not None],
    }
    print(_RESULT + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
