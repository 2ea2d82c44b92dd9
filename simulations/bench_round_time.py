"""Wall time of a simulated round: TernGrad against FedAvg (and GradientAverage), side by side.

Runs the same configuration with each strategy through ``fedddl simulate``'s Python API
(Flower's Ray simulation, one actor per ``--cpus-per-client`` CPUs), alternating the
strategies ``--repeats`` times, and prints each run's median round (the first round, which
pays Ray's start-up, is left out), then the median over runs and the TernGrad/FedAvg ratio.

    python simulations/bench_round_time.py --dataset digits --rounds 40
    python simulations/bench_round_time.py --dataset fashion-mnist --arch resnet8 --rounds 20

The last line reads ``median round: terngrad A s, fedavg B s, gradient-average C s
(terngrad/fedavg R)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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
    args = parser.parse_args(argv)

    from fedddl.app_config import AppConfig
    from fedddl.flower.simulation import run

    medians: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for repeat in range(args.repeats):
        for strategy in STRATEGIES:
            cfg = AppConfig(
                num_server_rounds=args.rounds,
                strategy=strategy,
                dataset=args.dataset,
                arch=args.arch,
                eval_every=args.eval_every or args.rounds,
            )
            start = time.perf_counter()
            result = run(cfg, num_clients=args.num_clients,
                         num_cpus_per_client=args.cpus_per_client, progress=None)
            walls = [r["wall_s"] for r in result["rounds"][1:]]
            medians[strategy].append(statistics.median(walls))
            took = time.perf_counter() - start
            print(
                f"run {repeat + 1} {strategy:16s} median round {medians[strategy][-1]:.3f} s "
                f"(min {min(walls):.3f}, max {max(walls):.3f}; run {took:.0f} s, "
                f"accuracy {result['final_accuracy']:.3f})",
                flush=True,
            )
    overall = {s: statistics.median(v) for s, v in medians.items()}
    print(
        "median round: "
        + ", ".join(f"{s} {overall[s]:.3f} s" for s in STRATEGIES)
        + f" (terngrad/fedavg {overall['terngrad'] / overall['fedavg']:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
