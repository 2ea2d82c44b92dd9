"""``fedddl testbed``: real runs over bandwidth-limited links between network namespaces.

Subcommands: ``check`` (is this machine able to?), ``flower`` (a TLS Flower
deployment, one SuperNode per namespace, strategies side by side on each
network), ``gossip`` (real gossip peers, one per namespace) and ``cleanup``
(namespaces listed in a record file of a run that was killed). Needs root.
See docs/testbed.md.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

NAME = "testbed"
HELP = "run Flower or gossip peers over rate-limited links between network namespaces (root)"

_REPO_ROOT = Path(__file__).resolve().parents[2]
_ITEM = re.compile(r"""([A-Za-z0-9_-]+)=('[^']*'|"[^"]*"|\S+)""")


def _value(text: str) -> str | int | float | bool:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"run-config value {text!r} is not a quoted string, number or boolean")


def parse_run_config(text: str) -> dict[str, Any]:
    """Parse Flower's ``--run-config`` syntax: ``key=value ...`` (quoted strings, numbers,
    ``true``/``false``)."""
    rest = _ITEM.sub("", text).strip()
    if rest:
        raise ValueError(f"cannot parse run config near {rest!r}")
    return {key: _value(value) for key, value in _ITEM.findall(text)}


def _flower_network(path: str, supernodes: int, load: Any) -> Any:
    """The profile at ``path`` with ``supernodes`` nodes, or ``supernodes + 1`` (the last one
    the SuperLink)."""
    from fedddl.network import NetworkError, NetworkModel

    try:
        return load(path, supernodes)
    except NetworkError:
        if Path(path).exists() and NetworkModel.from_file(path).num_nodes == supernodes + 1:
            return load(path, supernodes + 1)
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the subcommands of ``fedddl testbed``."""
    sub = parser.add_subparsers(dest="testbed_command", metavar="SUBCOMMAND", required=True)
    sub.add_parser("check", help="say whether namespaces, veth, htb and root are available")

    flower = sub.add_parser("flower", help="Flower deployment: strategies side by side per network")
    flower.add_argument("--supernodes", type=int, default=4,
                        help="SuperNodes, each in its own namespace")
    flower.add_argument("--network", action="append", default=[], metavar="FILE",
                        help="profile (JSON/TOML, one node per SuperNode, and one more "
                             "to shape the SuperLink's link too); repeatable, no default: "
                             "at least one")
    flower.add_argument("--strategies", default="terngrad,gradient-average,fedavg",
                        help="comma list of strategies run side by side on each network")
    flower.add_argument("--run-config", default="",
                        help="Flower run config, e.g. \"dataset='digits' num-server-rounds=20\" "
                             "(default: the app's defaults)")
    flower.add_argument("--target", type=float, required=True,
                        help="accuracy target (required, no default)")
    flower.add_argument("--repeats", type=int, default=1, help="runs of each strategy per network")
    flower.add_argument("--reference-rounds", type=int, default=None,
                        help="rounds of the unlimited reference runs (>= 2; default: the "
                             "run config's): they give the prediction's compute term only")
    flower.add_argument("--run-timeout", type=float, default=1800.0,
                        help="stop a run after this many seconds, not running it again "
                             "(default 1800)")
    flower.add_argument("--heartbeat-patience", type=int, default=None,
                        help="missed 30 s heartbeats the SuperLink and SuperNodes tolerate "
                             "(default: Flower's own, 2); more keeps runs alive on a machine "
                             "whose processes stall")
    flower.add_argument("--insecure", action="store_true", help="no TLS / SuperNode auth")
    flower.add_argument("--resume", action="store_true",
                        help="reuse results already in --out (e.g. the unlimited references)")
    flower.add_argument("--out", required=True, help="output directory (required, no default)")

    gossip = sub.add_parser("gossip", help="real gossip peers, one per namespace; the simulator")
    gossip.add_argument("--network", default="heterogeneous", help="profile name or file")
    gossip.add_argument("--nodes", type=int, default=8, help="gossip peers, one per namespace")
    gossip.add_argument("--variants", default="scheduled,random",
                        help="comma list of scheduled, random (classic), random+overlap, "
                             "scheduled+compressed (scheduled, sending --compressor differences)")
    gossip.add_argument("--compressor", default="ternary-base3",
                        help="compressor of the scheduled+compressed variant")
    gossip.add_argument("--steps", type=int, default=300, help="SGD steps of each peer")
    gossip.add_argument("--min-step-s", type=float, default=0.05,
                        help="pace each SGD step to at least this many seconds")
    gossip.add_argument("--dataset", default="digits", help="dataset name")
    gossip.add_argument("--arch", default="", help="model (default: the dataset's default model)")
    gossip.add_argument("--learning-rate", type=float, default=0.1, help="SGD learning rate")
    gossip.add_argument("--eval-every", type=int, default=10,
                        help="evaluate every this many steps")
    gossip.add_argument("--eval-samples", type=int, default=0,
                        help="test examples each evaluation uses, the same in the peers and "
                             "the simulator (default: 0, the whole test set)")
    gossip.add_argument("--seed", type=int, default=0, help="run seed")
    gossip.add_argument("--target", type=float, required=True,
                        help="accuracy target (required, no default)")
    gossip.add_argument("--repeats", type=int, default=1, help="runs of each variant")
    gossip.add_argument("--no-predict", action="store_true", help="skip the simulator")
    gossip.add_argument("--predict-to-target", action="store_true",
                        help="end each simulation at the target (large models: the simulator "
                             "trains every node, as long as the peers did)")
    gossip.add_argument("--resume", action="store_true",
                        help="reuse variants whose results are already in --out")
    gossip.add_argument("--out", required=True, help="output directory (required, no default)")

    cleanup = sub.add_parser("cleanup", help="delete the namespaces a killed run recorded")
    cleanup.add_argument("record", help="namespaces.json of that run")


#: label -> scheduler, overlap, whether the peers send compressed differences (--compressor)
_VARIANTS = {"scheduled": ("scheduled", True, False), "random": ("random", False, False),
             "random+overlap": ("random", True, False),
             "scheduled+compressed": ("scheduled", True, True)}


def gossip_variants(labels: str, compressor: str) -> list[tuple[str, str, bool, dict[str, str]]]:
    """The ``--variants`` list as :func:`fedddl.testbed.compare.gossip_matrix` takes it."""
    names = [v for v in labels.split(",") if v]
    unknown = set(names) - set(_VARIANTS)
    if unknown:
        raise ValueError(f"unknown gossip variants {sorted(unknown)}")
    variants = []
    for name in names:
        scheduler, overlap, compressed = _VARIANTS[name]
        extra = {"compressor": compressor} if compressed else {}
        variants.append((name, scheduler, overlap, extra))
    return variants


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """Run ``fedddl testbed SUBCOMMAND``."""
    from fedddl.deploy.processes import DeploymentError
    from fedddl.network import NetworkError, load_network
    from fedddl.testbed.netns import TestbedError, check_support, cleanup_recorded

    # SIGTERM / SIGHUP tear down like Ctrl-C: the finally blocks stop every process
    # and delete every namespace this run created.
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    try:
        if args.testbed_command == "cleanup":
            removed = cleanup_recorded(args.record)
            print(f"fedddl testbed: deleted {len(removed)} namespace(s): {' '.join(removed)}")
            return 0
        check_support()
        if args.testbed_command == "check":
            print("fedddl testbed: root, iproute2, namespaces, veth, htb and u32 are available")
            return 0
        if args.testbed_command == "flower":
            from fedddl.testbed.compare import flower_matrix

            networks = [(Path(p).stem, _flower_network(p, args.supernodes, load_network))
                        for p in args.network]
            flower_matrix(
                supernodes=args.supernodes, networks=networks,
                strategies=[s for s in args.strategies.split(",") if s],
                run_config=parse_run_config(args.run_config), target=args.target,
                repeats=args.repeats, out_dir=args.out, app_dir=_REPO_ROOT,
                tls=not args.insecure, resume=args.resume,
                reference_rounds=args.reference_rounds,
                heartbeat_patience=args.heartbeat_patience, run_timeout_s=args.run_timeout,
            )
        else:
            from fedddl.testbed.compare import gossip_matrix

            gossip_matrix(
                network_spec=args.network, nodes=args.nodes,
                variants=gossip_variants(args.variants, args.compressor),
                peer_options={"steps": args.steps, "min-step-s": args.min_step_s,
                              "dataset": args.dataset, "eval-every": args.eval_every,
                              "eval-samples": args.eval_samples,
                              "learning-rate": args.learning_rate,
                              **({"arch": args.arch} if args.arch else {})},
                target=args.target, repeats=args.repeats, out_dir=args.out, seed=args.seed,
                predict=not args.no_predict, resume=args.resume,
                predict_to_target=args.predict_to_target,
            )
        print((Path(args.out) / "summary.md").read_text())
        return 0
    except (TestbedError, DeploymentError, NetworkError, ValueError, OSError) as exc:
        print(f"fedddl testbed: error: {exc}", file=sys.stderr)
        return 2
