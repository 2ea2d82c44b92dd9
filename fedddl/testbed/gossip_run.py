"""Real gossip peers on the testbed: one ``python -m fedddl.gossip.peer`` per namespace.

Node ``i`` of a ``fedddl.network`` profile gets its own namespace; its link to
node ``j`` is an ``htb`` class capped at ``bandwidth_Bps[i][j]`` (its uplink is
the fastest of those, its downlink the fastest link into it), and the profile's
``latency_s[i][j]`` is added by the peer's own shaper (``--shaper``; no netem
here), once per message as in :class:`fedddl.network.NetworkModel`.

Peers talk over mutual TLS, as real peers must (namespace addresses are not
loopback, so ``--insecure`` is refused): the run issues one certificate per node
(:func:`fedddl.deploy.certs.write_tls_material`) into ``WORK_DIR/tls`` and gives each
peer ``--tls-dir``. Peers start, wait until every one serves, then all get the peer list at once
(``peers.json``) and train; the run ends when each has done its steps (or at the
time bound). The result has the shape of ``fedddl gossip``'s (``curve`` of mean
test accuracy over nodes against *real* seconds, ``time_to_target_s``,
``bytes_total``, ``messages``) plus the wire bytes of every interface and link.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedddl.deploy.certs import write_tls_material
from fedddl.deploy.managed_process import (
    DeploymentError,
    ManagedProcess,
    ProcessRegistry,
    start_process,
)
from fedddl.gossip.peer_files import METRICS_FILE, NODE_FILE, read_json, write_peers
from fedddl.network import NetworkModel
from fedddl.testbed.netns import LinkRates, Testbed

__all__ = ["PEER_PORT", "gossip_rates", "mean_accuracy_curve", "run_gossip_testbed"]

#: Port every peer serves on inside its own namespace.
PEER_PORT = 7000


def gossip_rates(network: NetworkModel) -> list[LinkRates]:
    """Per-link shaping of every node of ``network`` (see the module docstring)."""
    bw = network.bandwidth_Bps
    n = network.num_nodes
    rates = []
    for i in range(n):
        peers = {j: float(bw[i, j]) for j in range(n) if j != i}
        rates.append(LinkRates(
            uplink_Bps=max(peers.values()),
            downlink_Bps=max(float(bw[j, i]) for j in range(n) if j != i),
            per_peer_Bps=peers,
        ))
    return rates


def shaper_spec(network: NetworkModel, node: int) -> str:
    """``--shaper`` value adding the profile's latency of each link of ``node``."""
    return ",".join(
        f"{j}={float(network.latency_s[node, j])!r}"
        for j in range(network.num_nodes) if j != node
    )


def mean_accuracy_curve(metrics: Sequence[Mapping[str, Any]]) -> list[list[float]]:
    """``[[seconds, mean accuracy], ...]`` over nodes, from the peers' accuracy histories.

    Time 0 is the earliest training start; at every evaluation of any node the
    mean of each node's latest accuracy is taken (a node not yet evaluated
    counts with its first value).
    """
    start = min(float(m["started_at"]) for m in metrics)
    events = sorted(
        (float(m["started_at"]) + float(a["t"]) - start, i, float(a["accuracy"]))
        for i, m in enumerate(metrics) for a in m["accuracy"]
    )
    latest = [float(m["accuracy"][0]["accuracy"]) for m in metrics]
    curve: list[list[float]] = []
    for t, node, accuracy in events:
        latest[node] = accuracy
        mean = sum(latest) / len(latest)
        if curve and curve[-1][0] == t:
            curve[-1][1] = mean
        else:
            curve.append([t, mean])
    return curve


def run_gossip_testbed(
    network: NetworkModel,
    work_dir: str | os.PathLike[str],
    *,
    scheduler: str,
    overlap: bool,
    target: float,
    peer_options: Mapping[str, str | int | float],
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run one gossip training on the testbed; return the result (module docstring).

    Parameters
    ----------
    network : NetworkModel
        The profile: one node per namespace.
    work_dir : path
        State directories, logs and the namespace record.
    scheduler : str
        ``"scheduled"`` or ``"random"``.
    overlap : bool
        Compute while sending (False: classic gossip, wait for each send).
    target : float
        Mean accuracy whose first crossing gives ``time_to_target_s``.
    peer_options : mapping
        More ``python -m fedddl.gossip.peer`` options without dashes, e.g.
        ``{"steps": 300, "min-step-s": 0.05, "dataset": "digits"}``.
    timeout_s : float
        Bound on the whole run (peers also get it as ``--max-lifetime-s``).
    """
    work = Path(work_dir).resolve()
    n = network.num_nodes
    registry = ProcessRegistry()
    options = {"scheduler": scheduler, "max-lifetime-s": timeout_s, **peer_options}
    extra = [] if overlap else ["--no-overlap"]
    tls = write_tls_material(work / "tls", gossip_peers=n).gossip_dir
    net = Testbed(gossip_rates(network), record=work / "namespaces.json")
    try:
        net.up()
        peers: list[ManagedProcess] = []
        for i in range(n):
            argv = [sys.executable, "-m", "fedddl.gossip.peer", "--node-id", str(i),
                    "--num-nodes", str(n), "--bind", f"{net.address(i)}:{PEER_PORT}",
                    "--state-dir", str(work / f"node-{i}"), "--shaper", shaper_spec(network, i),
                    "--tls-dir", str(tls), *extra]
            for key, value in options.items():
                argv += [f"--{key}", str(value)]
            peers.append(registry.add(start_process(
                f"peer-{i}", argv, work / "logs", env=dict(os.environ), prefix=net.exec_prefix(i),
            )))
        deadline = time.monotonic() + timeout_s
        _wait(lambda: all(read_json(work / f"node-{i}" / NODE_FILE) for i in range(n)),
              peers, deadline, "every peer to serve")
        before = net.all_counters()
        addresses = {i: f"{net.address(i)}:{PEER_PORT}" for i in range(n)}
        for i in range(n):
            write_peers(work / f"node-{i}", addresses)
        _wait(lambda: not any(p.alive() for p in peers), [], deadline, "every peer to finish")
        after = net.all_counters()
        per_link = {str(i): {str(j): b for j, b in net.peer_bytes(i).items()} for i in range(n)}
    finally:
        try:
            registry.stop_all()
        finally:
            net.down()
    metrics = [read_json(work / f"node-{i}" / METRICS_FILE) or {} for i in range(n)]
    unfinished = [i for i, m in enumerate(metrics) if not m.get("finished")]
    if unfinished:
        raise DeploymentError(f"gossip peers {unfinished} did not finish; see {work}/logs")
    curve = mean_accuracy_curve(metrics)
    reached = next((t for t, acc in curve if acc >= target), None)
    return {
        "config": {"scheduler": scheduler, "overlap": overlap, "network": network.name,
                   "nodes": n, "target_accuracy": target, **options},
        "curve": curve,
        "time_to_target_s": reached,
        "final_accuracy": curve[-1][1],
        "bytes_total": sum(int(m["bytes_sent"]) for m in metrics),
        "messages": sum(int(m["sent"]) for m in metrics),
        "steps_per_node": [int(m["steps"]) for m in metrics],
        "steps_per_s": [float(m["steps_per_s"]) for m in metrics],
        "duration_s": max(float(m["finished_at"]) for m in metrics)
        - min(float(m["started_at"]) for m in metrics),
        "send_failures": sum(int(m["send_failures"]) for m in metrics),
        "testbed": {
            "wire_tx_bytes": _delta(after, before, "tx_bytes"),
            "wire_rx_bytes": _delta(after, before, "rx_bytes"),
            "link_bytes": per_link,
            "latency_emulated": "per message, by the peers' --shaper",
            "load_avg_after": list(os.getloadavg()),
        },
        "nodes": metrics,
    }


def _delta(after: Sequence[Mapping[str, int]], before: Sequence[Mapping[str, int]],
           key: str) -> int:
    return sum(a[key] - b[key] for a, b in zip(after, before, strict=True))


def _wait(done: Any, processes: Sequence[ManagedProcess], deadline: float, what: str) -> None:
    while not done():
        dead = [p.name for p in processes if not p.alive()]
        if dead:
            raise DeploymentError(f"waiting for {what}: {dead} exited early")
        if time.monotonic() > deadline:
            raise DeploymentError(f"timed out waiting for {what}")
        time.sleep(0.1)
