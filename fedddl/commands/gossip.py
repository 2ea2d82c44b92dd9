"""``fedddl gossip``: simulate gossip SGD (scheduled or random) on a modelled network."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

NAME = "gossip"
HELP = "simulate gossip SGD with real training under a virtual clock and write a JSON result"

_DATASETS = ("digits", "mnist", "fashion-mnist", "fashion-mnist-pairs", "cifar10", "cifar100",
             "tiny-imagenet")


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
    parser.add_argument(
        "--scheduler",
        default="scheduled",
        choices=("scheduled", "random"),
        help="scheduled: communication scheduling (the paper's method); random: classic gossip",
    )
    parser.add_argument(
        "--network", default="homogeneous",
        help="'homogeneous', 'heterogeneous' or a JSON/TOML network file",
    )
    parser.add_argument("--nodes", type=int, default=16, help="gossip peers (one model each)")
    parser.add_argument("--dataset", default="digits", choices=_DATASETS, help="dataset name")
    parser.add_argument(
        "--data-root", default=None, help="dataset directory (default: $FEDDDL_DATA or the "
        "dataset's standard place)",
    )
    parser.add_argument(
        "--partition",
        default="stratified",
        choices=("stratified", "random"),
        help="how the training set is split over the nodes",
    )
    parser.add_argument(
        "--arch", default=None, choices=("mlp", "cnn", "resnet18"),
        help="model architecture (default: the dataset's default model)",
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=0.9,
        help="mean test accuracy (a fraction, 0-1) that ends the run when first reached "
        "(see --continue-after-target); its virtual time is reported as time to target",
    )
    parser.add_argument(
        "--continue-after-target",
        action="store_true",
        help="keep running to --max-virtual-time after the target is reached",
    )
    parser.add_argument(
        "--stop-at-target",
        action="store_true",
        help="deprecated, kept for old scripts: stopping at the target is now the default",
    )
    parser.add_argument(
        "--max-virtual-time",
        type=float,
        default=60.0,
        help="simulated duration, in virtual seconds",
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help="seed of model init, shards, minibatches, schedulers and network",
    )
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of every node")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="samples per minibatch (one SGD step)"
    )
    parser.add_argument(
        "--compute-time-s", type=_compute_time, default=0.05,
        help="virtual seconds per SGD step, or 'measured' (real wall time here)",
    )
    parser.add_argument(
        "--compute-heterogeneity", type=float, default=0.0,
        help="node step time = compute-time * U[1, 1 + h] (h, unitless)",
    )
    parser.add_argument(
        "--eval-interval-s", type=float, default=1.0,
        help="virtual seconds between evaluations of every node",
    )
    parser.add_argument(
        "--eval-samples", type=int, default=1000,
        help="test samples per evaluation (0 = whole test set)",
    )
    parser.add_argument(
        "--exchange-every", type=int, default=1,
        help="share the model after every k-th local SGD step (k, steps)",
    )
    overlap = parser.add_mutually_exclusive_group()
    overlap.add_argument(
        "--overlap", dest="overlap", action="store_true", default=None,
        help="compute while sending (default for scheduled)",
    )
    overlap.add_argument(
        "--no-overlap", dest="overlap", action="store_false",
        help="wait for each send (default for random)",
    )
    parser.add_argument(
        "--stale-threshold-steps", type=float, default=10.0,
        help="a received model more than this many SGD steps behind the receiver is "
        "stale (counted, and skipped by the scheduler)",
    )
    parser.add_argument(
        "--merge-weight", type=float, default=0.5,
        help="share of the received model in the merge average, in [0, 1]",
    )
    parser.add_argument(
        "--selection", default="proportional", choices=("proportional", "fastest"),
        help="scheduled: probability ~ 1/estimated time, or the fastest enabled peer",
    )
    parser.add_argument(
        "--compressor", default="",
        help="send compressed model differences (CHOCO-style public copies) with this "
             "registered compressor, e.g. ternary-base3 (default: whole fp32 models)",
    )
    parser.add_argument(
        "--consensus-step", type=float, default=0.25,
        help="with --compressor: step of the CHOCO edge updates, replaces --merge-weight "
             "(default: 0.25)",
    )
    parser.add_argument(
        "--scale-bucket", type=int, default=0,
        help="with a ternary --compressor: 0 one scale per tensor, N per N values, "
             "-1 per output channel (default: 0)",
    )
    parser.add_argument(
        "--clip", type=float, default=0.25,
        help="clipped gossip: a neighbour's difference is clipped to this many times the "
             "median of the peers' recent difference norms; 0 = unclipped (default: 0.25)",
    )
    parser.add_argument(
        "--attack", default="", choices=("", "constant", "scaled-initial", "sign-flip"),
        help="compromised peers (--attackers of them, the highest ids) send poisoned models "
             "of this kind; accuracies are then the honest nodes' (default: none)",
    )
    parser.add_argument(
        "--attackers", type=int, default=None,
        help="how many nodes are compromised (default: 1 with --attack, else 0)",
    )
    parser.add_argument(
        "--attack-scale", type=float, default=None,
        help="the attack's value: constant 999, scaled-initial -50 (times the initial "
             "model), sign-flip -1 (times its own model) by default",
    )
    parser.add_argument("--out", default=None, help="result JSON file (default: stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    """Run ``fedddl gossip``."""
    from fedddl.gossip.sim_config import GossipConfig
    from fedddl.gossip.simulator import run_gossip
    from fedddl.network import NetworkError
    from fedddl.progress import Progress

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
            stop_at_target=not args.continue_after_target,
            selection=args.selection,
            compressor=args.compressor,
            consensus_step=args.consensus_step,
            scale_bucket=args.scale_bucket,
            clip=args.clip,
            attack=args.attack,
            attackers=(1 if args.attack else 0) if args.attackers is None else args.attackers,
            attack_scale=args.attack_scale,
        )
        if args.quiet:
            result = run_gossip(config)
        else:
            label = f"gossip {config.scheduler}"
            with Progress(config.max_virtual_time_s, label, unit="virtual s") as progress:
                result = run_gossip(config, progress=progress)
    except (NetworkError, ValueError, FileNotFoundError) as exc:
        print(f"fedddl gossip: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.out is None:
        print(text)
        print(f"fedddl gossip: {summary_line(result)}", file=sys.stderr)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        print(f"fedddl gossip: {summary_line(result)}, wrote {out}", file=sys.stderr)
    return 0


def summary_line(result: dict[str, Any]) -> str:
    """One line: final accuracy, when the target was reached, and why the run ended."""
    config = result["config"]
    reached = result["time_to_target_s"]
    end = result["curve"][-1][0] if result["curve"] else 0.0
    target = f"target {config['target_accuracy']:.4f}"
    if reached is None:
        when = f"{target} not reached within {config['max_virtual_time_s']:g} virtual s"
    elif config["stop_at_target"]:
        when = f"{target} reached at virtual t = {reached:.2f} s (run stopped there)"
    else:
        when = f"{target} reached at virtual t = {reached:.2f} s, ran on to {end:.2f} s"
    return f"final accuracy {result['final_accuracy']:.4f}; {when}"
