"""``fedddl partition``: split a dataset into shards and report how representative they are."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

NAME = "partition"
HELP = "split a dataset into shards and print per-shard label/feature statistics"

_METHODS = ("stratified", "random", "dirichlet")
_DATASETS = ("digits", "mnist", "fashion-mnist", "fashion-mnist-pairs", "cifar10", "cifar100",
             "tiny-imagenet")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``fedddl partition`` to ``parser``."""
    parser.add_argument("--dataset", default="digits", choices=_DATASETS, help="dataset name")
    parser.add_argument(
        "--split", default="train", choices=("train", "test"), help="which split to partition"
    )
    parser.add_argument("--num-shards", type=int, default=10, help="number of shards")
    parser.add_argument(
        "--method", default="stratified", choices=_METHODS, help="how samples go to shards"
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffling seed")
    parser.add_argument(
        "--alpha",
        type=float,
        default=0.5,
        help="Dirichlet concentration of --method dirichlet (smaller = more skewed)",
    )
    parser.add_argument(
        "--data-root", default=None, help="dataset directory (default: $FEDDDL_DATA or the "
        "dataset's standard place)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def format_report(report: dict[str, Any]) -> str:
    """Render a :func:`fedddl.partition.shard_report` result as a plain-text table."""
    has_features = "feature_mean_abs_dev" in (report["shards"][0] if report["shards"] else {})
    header = f"{'shard':>5} {'size':>7} {'max|dev|':>9} {'KL':>10}"
    if has_features:
        header += f" {'feat mean':>10} {'|Δmean|':>9} {'feat var':>9} {'|Δvar|':>9}"
    lines = [header, "-" * len(header)]
    for i, shard in enumerate(report["shards"]):
        line = (
            f"{i:>5} {shard['size']:>7} {shard['max_abs_deviation']:>9.4f} "
            f"{shard['kl_divergence']:>10.2e}"
        )
        if has_features and "feature_mean" in shard:
            line += (
                f" {shard['feature_mean']:>10.4f} {shard['feature_mean_abs_dev']:>9.2e}"
                f" {shard['feature_var']:>9.4f} {shard['feature_var_abs_dev']:>9.2e}"
            )
        lines.append(line)
    summary = report["summary"]
    lines.append("-" * len(header))
    lines.append(
        f"{summary['num_shards']} shards over {summary['num_samples']} samples, "
        f"sizes {summary['size_min']}..{summary['size_max']}, "
        f"disjoint={summary['disjoint']}, covers_all={summary['covers_all']}"
    )
    lines.append(
        f"max|dev| mean {summary['max_abs_deviation_mean']:.4f} "
        f"max {summary['max_abs_deviation_max']:.4f}; "
        f"KL mean {summary['kl_divergence_mean']:.2e} max {summary['kl_divergence_max']:.2e}"
    )
    if "feature_mean_abs_dev_mean" in summary:
        lines.append(
            f"|Δmean| mean {summary['feature_mean_abs_dev_mean']:.2e}, "
            f"|Δvar| mean {summary['feature_var_abs_dev_mean']:.2e}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Load the dataset, partition it and print the report; return the exit code."""
    from fedddl.data import as_tensors, get_labels, load_dataset
    from fedddl.partition import make_shards, shard_report

    try:
        dataset = load_dataset(args.dataset, root=args.data_root, split=args.split)
        labels = get_labels(dataset)
        shards = make_shards(args.method, labels, args.num_shards, seed=args.seed, alpha=args.alpha)
        # Feature statistics need the images in memory; Tiny ImageNet is read lazily.
        features = None if args.dataset == "tiny-imagenet" else as_tensors(dataset)[0].numpy()
        report = shard_report(labels, shards, features)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"fedddl partition: error: {error}", file=sys.stderr)
        return 2
    report["config"] = {
        "dataset": args.dataset,
        "split": args.split,
        "method": args.method,
        "num_shards": args.num_shards,
        "seed": args.seed,
        "alpha": args.alpha,
    }
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
