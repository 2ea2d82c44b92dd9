"""One compromised gossip peer of 8: honest accuracy with and without the merge clip.

Runs the discrete-event simulator (``fedddl gossip``) and real peers (8 in-process
:class:`~fedddl.gossip.peer_node.PeerNode` s on loopback, mutual TLS, the attacker
holding a valid certificate of its own), clean and with node 7 sending in-bound
poison, and prints a Markdown table (docs/gossip.md, "Compromised peers")::

    python -m simulations.gossip_compromised --out results.json
    python -m simulations.gossip_compromised --only peers --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedddl.data import as_tensors, get_labels, load_dataset
from fedddl.deploy.certs import write_tls_material
from fedddl.gossip.clip import DEFAULT_CLIP
from fedddl.gossip.local_peers import run_to_completion
from fedddl.gossip.peer_node import NodeConfig, PeerNode, TrainingData
from fedddl.gossip.simulator import run_gossip
from fedddl.gossip.tls import PeerTls
from fedddl.models import create_model
from fedddl.partition import make_shards

NODES = 8
ATTACKER = NODES - 1


def simulate(
    seed: int, clip: float, attack: str, compressor: str, seconds: float
) -> dict[str, Any]:
    """One 8-node simulator run; the honest nodes' mean final accuracy."""
    start = time.perf_counter()
    result = run_gossip({
        "nodes": NODES, "dataset": "digits", "seed": seed, "max_virtual_time_s": seconds,
        "eval_interval_s": 2.0, "clip": clip, "compressor": compressor,
        "attack": attack, "attackers": 1 if attack else 0,
    })
    return {
        "accuracy": result["final_accuracy"],
        "time_to_target_s": result["time_to_target_s"],
        "clipped": result["clipped"],
        "wall_s": time.perf_counter() - start,
    }


def real_peers(
    seed: int, clip: float, attack: str, compressor: str, steps: int, certs: Path,
    min_step_s: float,
) -> dict[str, Any]:
    """8 real peers (threads of this process) for ``steps`` steps each."""
    train = load_dataset("digits", None, split="train")
    test = load_dataset("digits", None, split="test")
    shards = make_shards("stratified", get_labels(train), NODES, seed=seed)
    x, y = as_tensors(train)
    x_test, y_test = as_tensors(test)
    nodes = []
    for i, shard in enumerate(shards):
        index = torch.from_numpy(shard)
        config = NodeConfig(
            node_id=i, steps=steps, seed=seed, clip=clip, compressor=compressor,
            eval_every=steps, attack=attack if i == ATTACKER else "", min_step_s=min_step_s,
        )
        data = TrainingData(x[index], y[index], x_test, y_test)
        nodes.append(PeerNode(config, create_model("digits", seed=seed), data,
                              tls=PeerTls.load(certs, i)))
    start = time.perf_counter()
    finished = run_to_completion(nodes, timeout_s=600)
    metrics = [n.metrics() for n in nodes]
    honest = [m for m in metrics if m["node_id"] != ATTACKER or not attack]
    clipped = {m["node_id"]: m["clipped"].get(f"node {ATTACKER}", {}) for m in honest}
    return {
        "accuracy": statistics.fmean(m["final_accuracy"] for m in honest),
        "min_accuracy": min(m["final_accuracy"] for m in honest),
        "finished": finished,
        "attacker_frames_clipped": sum(sum(c.values()) for c in clipped.values()),
        "attacker_frames_received": sum(
            m["received_from"].get(str(ATTACKER), 0) for m in honest
        ),
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    """Run the grid and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("sim", "peers"), default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--attacks", nargs="+", default=["constant", "scaled-initial"])
    parser.add_argument("--compressors", nargs="+", default=["", "ternary-base3"])
    parser.add_argument("--clip", type=float, default=DEFAULT_CLIP)
    parser.add_argument("--virtual-s", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--min-step-s", type=float, default=0.01)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_tls_material(Path(tmp), gossip_peers=NODES)
        assert paths.gossip_dir is not None
        certs = paths.gossip_dir
        for where in ("sim", "peers"):
            if args.only not in (None, where):
                continue
            for compressor in args.compressors:
                for attack in ("", *args.attacks):
                    for clip in (0.0, args.clip):
                        for seed in args.seeds:
                            if where == "sim":
                                out = simulate(seed, clip, attack, compressor, args.virtual_s)
                            else:
                                out = real_peers(seed, clip, attack, compressor, args.steps,
                                                 certs, args.min_step_s)
                            row = {"where": where, "compressor": compressor or "fp32",
                                   "attack": attack or "clean", "clip": clip, "seed": seed, **out}
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    print("\n" + table(rows))


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of rows of :func:`simulate` / :func:`real_peers` results (with
    ``where``, ``compressor``, ``attack``, ``clip``, ``seed``): one line per setting."""
    lines = ["| where | messages | attack | clip | honest accuracy (seeds) | mean | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["where"], r["compressor"], r["attack"], r["clip"]) for r in rows},
                  key=lambda k: (k[0] != "sim", k[1], k[2] != "clean", k[2], k[3]))
    for key in keys:
        group = [r for r in rows if (r["where"], r["compressor"], r["attack"], r["clip"]) == key]
        accs = " / ".join(f"{r['accuracy']:.3f}" for r in group)
        mean = statistics.fmean(r["accuracy"] for r in group)
        wall = statistics.fmean(r["wall_s"] for r in group)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]:g} | {accs} | {mean:.3f} "
                     f"| {wall:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
