"""``fedddl simulate``: run the Flower app in-process on simulated clients (on Ray or inline),
write JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TypeVar

from fedddl.bn_momentum_choice import AUTO as AUTO_BN
from fedddl.bn_momentum_choice import SAMPLED_MOMENTUM, parse_bn_momentum
from fedddl.scale_bucket_choice import AUTO as AUTO_BUCKET
from fedddl.scale_bucket_choice import parse_scale_bucket

T = TypeVar("T")

NAME = "simulate"
HELP = "run a Flower simulation (TernGrad, GradientAverage or FedAvg) and write results JSON"


def _argument_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse ``type``: its ``ValueError`` (which names the choices) becomes
    argparse's usage error, with the same message."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` options.

    Each option is a shortcut for one run-config key; ``--run-config`` sets any key of
    ``[tool.flwr.app.config]`` and is applied after the shortcuts.
    """
    parser.add_argument(
        "--strategy",
        default="terngrad",
        help="terngrad | gradient-average | fedavg | package.module:Class",
    )
    parser.add_argument(
        "--partition",
        default="stratified",
        choices=("stratified", "random", "dirichlet"),
        help="how the training set is split over the clients",
    )
    parser.add_argument(
        "--dirichlet-alpha",
        type=float,
        default=0.5,
        help="Dirichlet concentration of --partition dirichlet (smaller = more skewed)",
    )
    parser.add_argument("--dataset", default="digits", help="dataset name (digits is embedded)")
    parser.add_argument(
        "--data-root",
        default="",
        help="dataset directory (default: $FEDDDL_DATA or the dataset's standard place)",
    )
    parser.add_argument(
        "--arch",
        default="",
        help="mlp | cnn | resnet8 | resnet20 | resnet18 (default: the dataset's own)",
    )
    parser.add_argument("--num-clients", type=int, default=10, help="simulated clients")
    parser.add_argument("--rounds", type=int, default=100, help="server rounds")
    parser.add_argument("--seed", type=int, default=0, help="seed of model, shards and sampling")
    parser.add_argument(
        "--local-steps", type=int, default=1, help="SGD minibatch steps per client per round"
    )
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument(
        "--lr-milestones",
        default="",
        help="rounds after which the learning rate is multiplied by --lr-gamma, comma-separated, "
        "e.g. 200,300 (default: none, a constant rate)",
    )
    parser.add_argument(
        "--lr-gamma", type=float, default=0.1, help="factor per --lr-milestones step (default: 0.1)"
    )
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, in [0, 1)")
    parser.add_argument(
        "--bn-momentum",
        type=_argument_type(parse_bn_momentum),
        default=AUTO_BN,
        help="momentum of every BatchNorm layer, in (0, 1]: how far a round's pooled "
        f"statistics move the running ones; 0: the model's own (0.1) (default: auto, "
        f"{SAMPLED_MOMENTUM} with --fraction-train < 1, else 0)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="samples per minibatch per client"
    )
    parser.add_argument(
        "--model",
        default="",
        help="your own model, package.module:factory(input_shape, num_classes) (default: none)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N | auto (CUDA when present) (default: cpu)",
    )
    parser.add_argument(
        "--gpus-per-client",
        type=float,
        default=None,
        help="Ray GPU share per client, with --engine ray "
        "(default: 0 on the CPU, 1/num-clients on CUDA)",
    )
    parser.add_argument(
        "--compressor", default="ternary-base3", help="registered uplink compressor name (TernGrad)"
    )
    parser.add_argument(
        "--downlink",
        default="auto",
        choices=("auto", "reternarize", "shared-scale-sum", "grid"),
        help="how the server encodes the aggregate it broadcasts (auto: grid for TernGrad "
        "with --fraction-train < 1, else reternarize)",
    )
    parser.add_argument(
        "--clip-sigma",
        type=float,
        default=2.5,
        help="ternary gradient clipping, in standard deviations of each tensor",
    )
    parser.add_argument(
        "--error-feedback", action="store_true", help="client-side residual memory for the uplink"
    )
    parser.add_argument(
        "--fp32-min-numel",
        type=int,
        default=0,
        help="parameters with fewer elements travel in fp32 (default: 0, none)",
    )
    parser.add_argument(
        "--fp32-logits",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the last Linear layer's parameters travel in fp32 (default: on)",
    )
    parser.add_argument(
        "--fp32-warmup-rounds",
        type=int,
        default=0,
        help="first rounds send everything in fp32, in rounds (default: 0)",
    )
    parser.add_argument(
        "--scale-bucket",
        type=_argument_type(parse_scale_bucket),
        default=AUTO_BUCKET,
        help="ternary scales: 0 per tensor, N per N values, -1 per output channel; auto: "
        "-1 where the downlink and compressor allow it, else 0 (default: auto)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=1,
        help="evaluate every N rounds, and the last (default: 1)",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        help="evaluate on this many test examples, a seeded subset (default: 0, all)",
    )
    parser.add_argument(
        "--fraction-train",
        type=float,
        default=1.0,
        help="fraction of the clients sampled per round, in (0, 1]",
    )
    parser.add_argument(
        "--update-log-size",
        type=int,
        default=8,
        help="encoded updates (rounds) the server keeps for catching clients up",
    )
    parser.add_argument(
        "--plugins",
        default="",
        help="comma-separated modules to import first, e.g. custom compressors (default: none)",
    )
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="'KEY=VALUE ...'",
        help="run-config keys of [tool.flwr.app.config] in Flower's syntax (TOML values: "
        "strings in quotes), e.g. \"strategy='fedavg' min-replies=2\", or a .toml file; "
        "repeatable; applied after the shortcut options above, so it wins over them "
        "(default: none)",
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
    parser.add_argument(
        "--scale-bound-action",
        default="clip",
        choices=("clip", "drop"),
        help="what happens to a reply above the scale bound",
    )
    parser.add_argument(
        "--scale-bound-rounds",
        type=int,
        default=10,
        help="previous rounds whose scales join the bound's median",
    )
    parser.add_argument(
        "--scale-weight",
        type=float,
        default=3.0,
        help="a reply's scale above this multiple of the median is clipped to it (0: off)",
    )
    parser.add_argument(
        "--direction-check",
        type=float,
        default=0.1,
        help="drop a reply whose signs align with the others' vote below this fraction of "
        "the round's median alignment, or with over 2x its median non-zero count (0: off)",
    )
    parser.add_argument(
        "--statistics-bound",
        type=float,
        default=4.0,
        help="clip BatchNorm statistics to this many standard deviations of the server "
        "shadow's running statistics (0: off)",
    )
    parser.add_argument(
        "--norm-clip",
        type=float,
        default=1.5,
        help="per tensor, scale a reply whose norm is above this multiple of the round's "
        "median norm down to it (0: off)",
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
        "many-tensors) (default: none)",
    )
    parser.add_argument(
        "--num-attackers",
        type=int,
        default=0,
        help="evaluation: clients (chosen from --seed) that run --attack",
    )
    parser.add_argument(
        "--engine",
        default="ray",
        choices=("ray", "inline"),
        help="in-process engine: ray (one Ray actor per client, clients train in parallel) "
        "or inline (no Ray: the clients of a round run one after another in this process, "
        "replies in node order); the same apps, bytes and replicas per round",
    )
    parser.add_argument(
        "--cpus-per-client",
        type=float,
        default=1.0,
        help="Ray CPUs per client, with --engine ray (1: one actor per core)",
    )
    parser.add_argument("--out", default="", help="results JSON path (default: not written)")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress lines")


def run(args: argparse.Namespace) -> int:
    """Run the simulation; exit code 0 on success, 2 on a bad configuration."""
    from fedddl.app_config import AppConfig
    from fedddl.flower.simulation import run as simulate
    from fedddl.partition import PartitionError

    try:
        cfg = AppConfig(
            num_server_rounds=args.rounds,
            strategy=args.strategy,
            dataset=args.dataset,
            data_root=args.data_root,
            arch=args.arch,
            model=args.model,
            device=args.device,
            fp32_min_numel=args.fp32_min_numel,
            fp32_logits=args.fp32_logits,
            fp32_warmup_rounds=args.fp32_warmup_rounds,
            scale_bucket=args.scale_bucket,
            eval_every=args.eval_every,
            eval_samples=args.eval_samples,
            partition=args.partition,
            dirichlet_alpha=args.dirichlet_alpha,
            seed=args.seed,
            learning_rate=args.lr,
            lr_milestones=args.lr_milestones,
            lr_gamma=args.lr_gamma,
            momentum=args.momentum,
            bn_momentum=args.bn_momentum,
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
            scale_weight=args.scale_weight,
            resync_interval=args.resync_interval,
            direction_check=args.direction_check,
            statistics_bound=args.statistics_bound,
            norm_clip=args.norm_clip,
            attack=args.attack,
            num_attackers=args.num_attackers,
        )
        if args.run_config:
            from fedddl.flower.run_config import parse_run_config

            cfg = cfg.updated(parse_run_config(args.run_config))
        if args.num_clients < 1:
            raise ValueError(f"--num-clients must be >= 1, got {args.num_clients}")
        if args.num_attackers > args.num_clients:
            raise ValueError(
                f"--num-attackers {args.num_attackers} exceeds --num-clients {args.num_clients}"
            )
    except ValueError as err:
        print(f"fedddl simulate: {err}", file=sys.stderr)
        return 2
    from fedddl.progress import Progress

    progress = None if args.quiet else Progress(cfg.num_server_rounds, NAME, unit="rounds")
    try:
        result = simulate(
            cfg,
            num_clients=args.num_clients,
            engine=args.engine,
            num_cpus_per_client=args.cpus_per_client,
            num_gpus_per_client=args.gpus_per_client,
            out=args.out or None,
            progress=progress,
        )
    except PartitionError as err:
        print(f"fedddl simulate: {err}", file=sys.stderr)
        return 2
    finally:
        if progress is not None:
            progress.close()
    print(json.dumps(result["summary"]))
    return 0
