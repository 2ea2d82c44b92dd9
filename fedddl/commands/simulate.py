"""``fedddl simulate``: run the Flower app in-process on simulated clients, write JSON."""

from __future__ import annotations

import argparse
import json
import sys

NAME = "simulate"
HELP = "run a Flower simulation (TernGrad, GradientAverage or FedAvg) and write results JSON"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` options."""
    parser.add_argument(
        "--strategy",
        default="terngrad",
        help="terngrad | gradient-average | fedavg | package.module:Class",
    )
    parser.add_argument(
        "--partition", default="stratified", choices=("stratified", "random", "dirichlet")
    )
    parser.add_argument("--dirichlet-alpha", type=float, default=0.5)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-root", default="")
    parser.add_argument("--arch", default="", help="mlp | cnn | resnet18 (default: per dataset)")
    parser.add_argument("--num-clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--compressor", default="ternary-base3", help="registered uplink compressor name (TernGrad)"
    )
    parser.add_argument(
        "--downlink", default="reternarize", choices=("reternarize", "shared-scale-sum")
    )
    parser.add_argument("--clip-sigma", type=float, default=2.5)
    parser.add_argument(
        "--error-feedback", action="store_true", help="client-side residual memory for the uplink"
    )
    parser.add_argument("--fraction-train", type=float, default=1.0)
    parser.add_argument("--update-log-size", type=int, default=8)
    parser.add_argument(
        "--plugins", default="", help="comma-separated modules to import first (custom compressors)"
    )
    # Defences of the TernGrad-family server and attack injection (untrusted clients).
    parser.add_argument(
        "--aggregator",
        default="mean",
        choices=("mean", "median", "trimmed-mean", "sign-vote"),
        help="how the server combines the accepted gradients",
    )
    parser.add_argument(
        "--trim-fraction", type=float, default=0.2, help="share cut from each end (trimmed-mean)"
    )
    parser.add_argument(
        "--scale-bound",
        type=float,
        default=8.0,
        help="clip/drop ternary scales above this x the round's median scale (0: off)",
    )
    parser.add_argument("--scale-bound-action", default="clip", choices=("clip", "drop"))
    parser.add_argument(
        "--scale-bound-rounds",
        type=int,
        default=10,
        help="previous rounds whose scales join the bound's median",
    )
    parser.add_argument(
        "--resync-interval",
        type=int,
        default=30,
        help="serve the resyncs a node causes at most once every N rounds (0: no limit)",
    )
    parser.add_argument(
        "--attack",
        default="",
        help="evaluation: KIND[:ARG] run by --num-attackers clients (scale:S, sign-flip, "
        "all-plus, nan-metrics, inf-metrics, huge-examples, resync-spam, fingerprint-lie, "
        "many-tensors)",
    )
    parser.add_argument("--num-attackers", type=int, default=0)
    parser.add_argument(
        "--cpus-per-client",
        type=float,
        default=1.0,
        help="Ray CPUs per client (1: one actor per core)",
    )
    parser.add_argument("--out", default="", help="results JSON path")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress lines")


def run(args: argparse.Namespace) -> int:
    """Run the simulation; exit code 0 on success, 2 on a bad configuration."""
    from fedddl.app_config import AppConfig
    from fedddl.flower.simulation import run as simulate

    try:
        cfg = AppConfig(
            num_server_rounds=args.rounds,
            strategy=args.strategy,
            dataset=args.dataset,
            data_root=args.data_root,
            arch=args.arch,
            partition=args.partition,
            dirichlet_alpha=args.dirichlet_alpha,
            seed=args.seed,
            learning_rate=args.lr,
            momentum=args.momentum,
            batch_size=args.batch_size,
            local_steps=args.local_steps,
            fraction_train=args.fraction_train,
            compressor=args.compressor,
            downlink=args.downlink,
            clip_sigma=args.clip_sigma,
            error_feedback=args.error_feedback,
            update_log_size=args.update_log_size,
            plugins=args.plugins,
            aggregator=args.aggregator,
            trim_fraction=args.trim_fraction,
            scale_bound=args.scale_bound,
            scale_bound_action=args.scale_bound_action,
            scale_bound_rounds=args.scale_bound_rounds,
            resync_interval=args.resync_interval,
            attack=args.attack,
            num_attackers=args.num_attackers,
        )
        if args.num_clients < 1:
            raise ValueError(f"--num-clients must be >= 1, got {args.num_clients}")
        if args.num_attackers > args.num_clients:
            raise ValueError(
                f"--num-attackers {args.num_attackers} exceeds --num-clients {args.num_clients}"
            )
    except ValueError as err:
        print(f"fedddl simulate: {err}", file=sys.stderr)
        return 2
    result = simulate(
        cfg,
        num_clients=args.num_clients,
        num_cpus_per_client=args.cpus_per_client,
        out=args.out or None,
        progress=None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True)),
    )
    print(json.dumps(result["summary"]))
    return 0
