"""The long-lived gossip node process: ``python -m fedddl.gossip.peer ...``.

It loads its shard, serves the gRPC peer service -- with mutual TLS from
``--tls-dir DIR`` (see :mod:`fedddl.gossip.tls`), or, with an explicit
``--insecure``, plaintext on loopback only --, waits for its peer list
(``--peers`` or ``<state dir>/peers.json``), trains ``--steps`` steps while
gossiping, lingers ``--linger-s`` so late messages still get an answer, and
exits. Metrics go to a JSON file every ``--metrics-interval-s``, at exit and on
SIGTERM/SIGINT (graceful stop). ``--max-lifetime-s`` bounds the process's life
so an orphaned peer always goes away. See :mod:`fedddl.gossip.peer_files`
for the state directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from fedddl.gossip.attack import GOSSIP_ATTACKS
from fedddl.gossip.clip import DEFAULT_CLIP
from fedddl.gossip.sim_config import GossipConfig

__all__ = ["build_parser", "main"]

_log = logging.getLogger("fedddl.gossip.peer")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of a peer process."""
    p = argparse.ArgumentParser(prog="python -m fedddl.gossip.peer", description=__doc__)
    p.add_argument("--node-id", type=int, required=True, help="this node's gossip id (0..N-1)")
    p.add_argument("--num-nodes", type=int, required=True, help="number of nodes (shards)")
    p.add_argument("--bind", default="127.0.0.1:0", help="host:port to serve on (0 = any free)")
    security = p.add_mutually_exclusive_group()
    security.add_argument("--tls-dir", default="",
                          help="mutual TLS: folder with ca.crt and node-<id>.pem/.key "
                               "(fedddl deploy certs OUT --gossip-peers N writes OUT/gossip)")
    security.add_argument("--insecure", action="store_true",
                          help="no TLS: unauthenticated plaintext, loopback addresses only")
    p.add_argument("--advertise", default="", help="host:port others reach us at (default: bind)")
    p.add_argument("--peers", default="", help="ID=HOST:PORT,... (else wait for peers.json)")
    p.add_argument("--state-dir", default="", help="folder for node/peers/metrics JSON files")
    p.add_argument("--metrics-path", default="", help="metrics JSON (default <state-dir>/metrics)")
    p.add_argument("--dataset", default="digits", help="dataset of every node (default: digits)")
    p.add_argument("--data-root", default="",
                   help="dataset directory (default: the standard place)")
    p.add_argument("--partition", default="stratified",
                   help="how the dataset is split into shards (default: stratified)")
    p.add_argument("--arch", default="",
                   help="model architecture (default: the dataset's own model)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument("--steps", type=int, default=300,
                   help="local SGD steps, then the node finishes (default: 300)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default: 32)")
    p.add_argument("--learning-rate", type=float, default=0.1,
                   help="SGD learning rate (default: 0.1)")
    p.add_argument("--scheduler", default="scheduled", help="scheduled | random")
    p.add_argument("--merge", default="average", help="average | version (uncompressed only)")
    p.add_argument("--compressor", default="",
                   help="send compressed model differences (CHOCO-style public copies) with "
                        "this registered compressor, e.g. ternary-base3; default: fp32 models")
    p.add_argument("--consensus-step", type=float, default=GossipConfig.consensus_step,
                   help="with --compressor: step of the edge updates")
    p.add_argument("--scale-bucket", type=int, default=GossipConfig.scale_bucket,
                   help="with a ternary --compressor: 0 one scale per tensor, N per N "
                        "values, -1 per output channel")
    p.add_argument("--max-model-rate", type=float, default=50.0,
                   help="model frames per second accepted from (and sent to) one peer")
    p.add_argument("--model-burst", type=int, default=10, help="burst of that rate limit")
    p.add_argument("--max-version-jump", type=int, default=1000,
                   help="largest step a received model clock may be ahead of the highest seen")
    p.add_argument("--max-abs-weight", type=float, default=1000.0,
                   help="largest absolute weight a received model may hold")
    p.add_argument("--clip", type=float, default=DEFAULT_CLIP,
                   help="clipped gossip: a neighbour's difference is clipped to this many "
                        "times the median of the peers' recent difference norms; 0 = off "
                        f"(default: {DEFAULT_CLIP:g})")
    p.add_argument("--attack", default="", choices=("", *GOSSIP_ATTACKS),
                   help="robustness tests only: this node is compromised and sends poisoned "
                        "models of this kind (default: none)")
    p.add_argument("--attack-scale", type=float, default=None,
                   help="the attack's value (default: the kind's own)")
    p.add_argument("--eval-every", type=int, default=25,
                   help="evaluate every this many steps (default: 25)")
    p.add_argument("--eval-samples", type=int, default=0,
                   help="evaluate on this many test examples drawn from --seed, as the "
                        "simulator's eval_samples (default: 0, the whole test set)")
    p.add_argument("--min-step-s", type=float, default=0.0, help="pace steps (emulate slow CPU)")
    p.add_argument("--send-timeout-s", type=float, default=2.0,
                   help="deadline of one send, in seconds (default: 2.0)")
    p.add_argument(
        "--no-overlap", action="store_true",
        help="classic gossip: after each step send a snapshot and wait for it (no sender thread)",
    )
    p.add_argument("--shaper", default="", help="link delays: '*=LAT_S[/BW_BPS],ID=...'")
    p.add_argument("--max-frame-bytes", type=int, default=64 * 1024 * 1024,
                   help="largest frame accepted or sent (default: 64 MiB)")
    p.add_argument("--peers-timeout-s", type=float, default=120.0,
                   help="how long to wait for the peer list, in seconds (default: 120)")
    p.add_argument("--linger-s", type=float, default=1.0,
                   help="keep serving this long after finishing, in seconds (default: 1.0)")
    p.add_argument("--metrics-interval-s", type=float, default=0.5,
                   help="write the metrics file this often, in seconds (default: 0.5)")
    p.add_argument("--max-lifetime-s", type=float, default=900.0,
                   help="stop training after this many seconds, finished or not (default: 900)")
    p.add_argument("--log-level", default="WARNING",
                   help="logging level (default: WARNING)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one gossip node until it finishes, is signalled or outlives its lifetime."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s node{args.node_id} %(levelname)s %(name)s: %(message)s",
    )
    stop = threading.Event()
    trained = threading.Event()  # a signal after training finished is no failure
    reason = {"exit": "finished"}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if not trained.is_set():
            reason["exit"] = signal.Signals(signum).name
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    born = time.monotonic()

    # Heavy imports after the signal handlers, so an early SIGTERM is graceful too.
    import torch

    from fedddl.gossip.admission import AdmissionLimits
    from fedddl.gossip.peer_files import (
        METRICS_FILE,
        NODE_FILE,
        PEERS_FILE,
        parse_peers,
        read_peers,
        write_json,
    )
    from fedddl.gossip.peer_node import NodeConfig, PeerNode
    from fedddl.gossip.tls import PeerTls
    from fedddl.gossip.transport import parse_shaper_spec

    torch.set_num_threads(1)  # many nodes share few cores
    state_dir = Path(args.state_dir) if args.state_dir else None
    metrics_path = Path(args.metrics_path) if args.metrics_path else None
    if metrics_path is None and state_dir is not None:
        metrics_path = state_dir / METRICS_FILE
    if not args.peers and state_dir is None:
        print("error: give --peers or --state-dir (to wait for peers.json)", file=sys.stderr)
        return 2
    if not args.tls_dir and not args.insecure:
        print("error: give --tls-dir DIR (mutual TLS) or --insecure (loopback only)",
              file=sys.stderr)
        return 2
    if args.insecure:
        print(f"WARNING: gossip node {args.node_id} runs --insecure: frames travel in plaintext "
              "and nobody is authenticated; only loopback addresses are allowed",
              file=sys.stderr, flush=True)
    try:
        tls = PeerTls.load(args.tls_dir, args.node_id) if args.tls_dir else None
        limits = AdmissionLimits(
            max_model_rate=args.max_model_rate,
            model_burst=args.model_burst,
            max_version_jump=args.max_version_jump,
            max_abs_weight=args.max_abs_weight,
        )
        config = NodeConfig(
            node_id=args.node_id,
            steps=args.steps,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            scheduler=args.scheduler,
            merge=args.merge,
            eval_every=args.eval_every,
            min_step_s=args.min_step_s,
            send_timeout_s=args.send_timeout_s,
            overlap=not args.no_overlap,
            max_frame_bytes=args.max_frame_bytes,
            seed=args.seed,
            compressor=args.compressor,
            consensus_step=args.consensus_step,
            scale_bucket=args.scale_bucket,
            limits=limits,
            clip=args.clip,
            attack=args.attack,
            attack_scale=args.attack_scale,
        )
        peers = parse_peers(args.peers) if args.peers else None
        shaper = parse_shaper_spec(args.shaper)
        model, data = _load(args)
        node = PeerNode(config, model, data, bind=args.bind, shaper=shaper, tls=tls)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    extra: dict[str, Any] = {"pid": os.getpid(), "exit_reason": None}

    def dump() -> None:
        if metrics_path is not None:
            write_json(metrics_path, {**node.metrics(), **extra})

    node.serve()
    advertised = args.advertise or node.server.address
    if state_dir is not None:
        write_json(
            state_dir / NODE_FILE,
            {"pid": os.getpid(), "node_id": args.node_id, "port": node.server.port,
             "address": advertised},
        )
    _log.info("serving on %s", node.server.address)
    try:

        def lifetime_left() -> float:
            return float(args.max_lifetime_s - (time.monotonic() - born))

        deadline = time.monotonic() + args.peers_timeout_s
        while peers is None and not stop.is_set():
            assert state_dir is not None
            peers = read_peers(state_dir / PEERS_FILE)
            if peers is None and time.monotonic() > deadline:
                reason["exit"] = "no peer list"
                stop.set()
            stop.wait(0.05)
        if peers is not None and not stop.is_set():
            node.set_peers(peers)  # ValueError (insecure, non-loopback peer) ends the run
            node.start_training()
            while not node.wait_done(args.metrics_interval_s):
                dump()
                if stop.is_set() or lifetime_left() <= 0:
                    reason["exit"] = reason["exit"] if stop.is_set() else "max lifetime"
                    break
            if node.error is not None:
                reason["exit"] = node.error
            elif node.wait_done(0) and node.metrics()["finished"]:
                trained.set()
                reason["exit"] = "finished"
                extra["finished_training_at"] = time.time()
                dump()
                stop.wait(max(0.0, min(args.linger_s, lifetime_left())))
    except Exception as exc:  # still write what we have
        reason["exit"] = f"error: {exc!r}"
        _log.exception("peer failed")
    finally:
        node.stop()
        extra["exit_reason"] = reason["exit"]
        extra["exited"] = True
        dump()
    return 0 if reason["exit"] in ("finished", "SIGTERM", "SIGINT") else 1


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from fedddl.data import as_tensors, get_labels, load_dataset
    from fedddl.gossip.eval_subset import eval_subset
    from fedddl.gossip.peer_node import TrainingData
    from fedddl.models import create_model
    from fedddl.partition import make_shards

    if not 0 <= args.node_id < args.num_nodes:
        raise ValueError(f"--node-id {args.node_id} must be in [0, --num-nodes={args.num_nodes})")
    root = args.data_root or None
    train = load_dataset(args.dataset, root, split="train")
    test = load_dataset(args.dataset, root, split="test")
    shard = make_shards(args.partition, get_labels(train), args.num_nodes, seed=args.seed)
    x, y = as_tensors(train)
    x_test, y_test = eval_subset(*as_tensors(test), args.eval_samples, args.seed)
    index = shard[args.node_id]
    model = create_model(args.dataset, seed=args.seed, arch=args.arch or None)
    return model, TrainingData(x[index], y[index], x_test, y_test)


if __name__ == "__main__":
    code = main()
    # Everything is written and flushed; skip the slow torch/grpc interpreter teardown
    # so "exited" in the metrics file means the process is gone a moment later.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
