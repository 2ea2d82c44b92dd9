"""``fedddl gossip``: simulate gossip SGD (scheduled or random) on a modelled network."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAME = "gossip"
HELP = "simulate gossip SGD with real training under a virtual clock and write a JSON result"

_DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "tiny-imagenet")


def _compute_time(text: str) -> float | None:
    if text == "measured":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--compute-time-s must be seconds or 'measured', got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--compute-time-s must be > 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``fedddl gossip`` to ``parser``."""
    parser.add_argument("--scheduler", default="scheduled", choices=("scheduled", "random"))
    parser.add_argument(
        "--network", default="homogeneous",
        help="'homogeneous', 'heterogeneous' or a JSON/TOML network file",
    )
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--dataset", default="digits", choices=_DATASETS)
    parser.add_argument("--data-root", default=None, help="dataset directory ($FEDDDL_DATA)")
    parser.add_argument("--partition", default="stratified", choices=("stratified", "random"))
    parser.add_argument("--arch", default=None, choices=("mlp", "cnn", "resnet18"))
    parser.add_argument("--target-accuracy", type=float, default=0.9)
    parser.add_argument("--max-virtual-time", type=float, default=60.0, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--compute-time-s", type=_compute_time, default=0.05,
        help="virtual seconds per SGD step, or 'measured' (real wall time here)",
    )
    parser.add_argument(
        "--compute-heterogeneity", type=float, default=0.0,
        help="node step time = compute-time * U[1, 1 + h]",
    )
    parser.add_argument("--eval-interval-s", type=float, default=1.0)
    parser.add_argument("--eval-samples", type=int, default=1000, help="0 = whole test set")
    parser.add_argument("--exchange-every", type=int, default=1, help="share every k steps")
    overlap = parser.add_mutually_exclusive_group()
    overlap.add_argument(
        "--overlap", dest="overlap", action="store_true", default=None,
        help="compute while sending (default for scheduled)",
    )
    overlap.add_argument(
        "--no-overlap", dest="overlap", action="store_false",
        help="wait for each send (default for random)",
    )
    parser.add_argument("--stale-threshold-steps", type=float, default=10.0)
    parser.add_argument("--merge-weight", type=float, default=0.5)
    parser.add_argument(
        "--selection", default="proportional", choices=("proportional", "fastest"),
        help="scheduled: probability ~ 1/estimated time, or the fastest enabled peer",
    )
    parser.add_argument(
        "--compressor", default="",
        help="send compressed model differences (CHOCO-style public copies) with this "
             "registered compressor, e.g. ternary-base3; default: whole fp32 models",
    )
    parser.add_argument(
        "--consensus-step", type=float, default=0.25,
        help="with --compressor: step of the CHOCO edge updates (replaces --merge-weight)",
    )
    parser.add_argument("--stop-at-target", action="store_true")
    parser.add_argument("--out", default=None, help="result JSON file (default: stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    """Run ``fedddl gossip``."""
    from fedddl.gossip.sim_config import GossipConfig
    from fedddl.gossip.simulator import run_gossip, stderr_progress
    from fedddl.network import NetworkError

    try:
        config = GossipConfig(
            scheduler=args.scheduler,
            network=args.network,
            nodes=args.nodes,
            dataset=args.dataset,
            data_root=args.data_root,
            partition=args.partition,
            arch=args.arch,
            target_accuracy=args.target_accuracy,
            max_virtual_time_s=args.max_virtual_time,
            seed=args.seed,
            lr=args.lr,
            batch_size=args.batch_size,
            compute_time_s=args.compute_time_s,
            compute_heterogeneity=args.compute_heterogeneity,
            eval_interval_s=args.eval_interval_s,
            eval_samples=args.eval_samples,
            exchange_every=args.exchange_every,
            overlap=args.overlap,
            stale_threshold_steps=args.stale_threshold_steps,
            merge_weight=args.merge_weight,
            stop_at_target=args.stop_at_target,
            selection=args.selection,
            compressor=args.compressor,
            consensus_step=args.consensus_step,
        )
        result = run_gossip(config, progress=None if args.quiet else stderr_progress)
    except (NetworkError, ValueError, FileNotFoundError) as exc:
        print(f"fedddl gossip: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.out is None:
        print(text)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        reached = result["time_to_target_s"]
        print(
            f"fedddl gossip: final accuracy {result['final_accuracy']:.4f}, time to target "
            f"{'never' if reached is None else f'{reached:.2f} s'}, wrote {out}",
            file=sys.stderr,
        )
    return 0
