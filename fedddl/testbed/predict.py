"""What the simulators predict for a testbed run, to set next to what was measured.

Flower runs (:func:`predict_flower`) use the ``fedddl.network`` model on a star:
SuperNode ``i`` reaches the SuperLink over its own access link (uplink
``B_up_i``, downlink ``B_down_i``, latency ``L``), all clients in parallel, so a
synchronous round takes::

    t_round(k) = c(k) + max_i (L + w up_i(k) / B_up_i) + max_i (L + w down_i(k) / B_down_i)

with ``up_i`` / ``down_i`` the round's byte totals of the application's count
split evenly over the clients, plus, in round 1, the app bundle (FAB) every
SuperNode downloads, and ``w`` the bytes a shaped link carries per application
byte (:data:`WIRE_FACTOR`, Ethernet + IPv4 + TCP framing; 1 gives the simulator's
``bytes / bandwidth``). When the SuperLink's own link is shaped too (``server``,
uplink ``S_up``, downlink ``S_down``), every client's transfer also crosses it,
shared, so each direction takes the longer of the two bottlenecks::

    up(k) = max(max_i (L + w up_i(k) / B_up_i), L + w sum_i up_i(k) / S_down)

(and the same for the downlink with ``S_up``). ``c(k)`` is measured on the *same
testbed without limits* (a reference run of the same configuration): its round 1
and the median of its other rounds. Nothing else of the testbed run enters the
prediction except its byte counts and its accuracy per round (training is the
same with and without limits).

On a CPU-bound machine the reference's transfers are not free: moving a 45 MB
message through TLS and gRPC keeps the CPUs busy for seconds, and ``c(k)``
already holds that time. With the reference's measured transfer spans (its
``.activity.json``, :func:`transfer_floor`: ``F_up``, ``F_down``, the median over
its rounds after the first of the first client's start to the last client's end)
a shaped direction adds only what it takes beyond them, for rounds after the first::

    t_round(k) = c(k) + max(0, up(k) - F_up) + max(0, down(k) - F_down)

Gossip runs (:func:`predict_gossip`) run the discrete-event simulator
(:func:`fedddl.gossip.run_gossip`) with the same network, nodes, data and
optimiser, and the peers' measured step time as its compute time. For a
*corrected* prediction, the receiver's downlink is not held during a transfer's
latency (``downlink_holds_latency=False``, see :class:`fedddl.network.LinkScheduler`)
and every link's latency is raised by the measured per-message software overhead
(:func:`message_overhead`: what the peers' transfer times exceed the network
model's by).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedddl.network import NetworkModel
from fedddl.testbed.activity import rounds_activity
from fedddl.testbed.flower_run import TCP_OVERHEAD
from fedddl.testbed.netns import LinkRates

__all__ = ["WIRE_FACTOR", "message_overhead", "predict_flower", "predict_gossip", "ratio",
           "star_network", "transfer_floor"]

#: Bytes on a shaped link per application byte of a large message: full TCP segments of
#: 1448 payload bytes in 1514-byte frames (``htb`` counts whole frames).
WIRE_FACTOR = 1.0 + TCP_OVERHEAD


def star_network(clients: Sequence[LinkRates], latency_s: float = 0.0) -> NetworkModel:
    """``N + 1``-node network: clients ``0..N-1`` and the server ``N`` on their access links.

    Unlimited directions get 1e12 bytes/s (no measurable time).
    """
    n = len(clients)
    big = 1e12
    bandwidth = [[big] * (n + 1) for _ in range(n + 1)]
    for i, rates in enumerate(clients):
        bandwidth[i][n] = rates.uplink_Bps or big
        bandwidth[n][i] = rates.downlink_Bps or big
    latency = [[latency_s] * (n + 1) for _ in range(n + 1)]
    return NetworkModel(latency, bandwidth, name="star")


def predict_flower(
    result: Mapping[str, Any],
    reference: Mapping[str, Any],
    clients: Sequence[LinkRates],
    *,
    fab_bytes: int = 0,
    latency_s: float = 0.0,
    target: float | None = None,
    wire_factor: float = WIRE_FACTOR,
    server: LinkRates | None = None,
    transfer_floor_s: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Predicted round times and time to ``target`` of the testbed run ``result``.

    Parameters
    ----------
    result, reference : mapping
        Results JSON of the run and of the unlimited reference run.
    clients : sequence of LinkRates
        The run's SuperNode access links.
    fab_bytes : int
        Size of the app bundle each SuperNode fetches in round 1.
    latency_s : float
        One-way latency of every access link.
    target : float, optional
        Accuracy target.
    wire_factor : float
        Link bytes per application byte (1.0: the simulator's model).
    server : LinkRates, optional
        The SuperLink's access link, shared by every client's transfers (None: not
        shaped).
    transfer_floor_s : mapping, optional
        ``{"up": F_up, "down": F_down}`` (:func:`transfer_floor` of the reference): seconds
        the reference's own transfers took, subtracted from each later round's transfer
        times (never below 0). None: every transfer adds its whole time.

    Returns
    -------
    dict
        ``round_s`` (predicted per round), ``compute_s`` (round 1 and later rounds),
        ``transfer_s`` (sum over rounds, after the floor), ``fab_s``, ``total_s``,
        ``time_to_target_s`` and ``transfer_floor_s``.
    """
    floor = transfer_floor_s or {}
    rounds = sorted(result["rounds"], key=lambda r: int(r["round"]))
    ref = [float(r["wall_s"]) for r in sorted(reference["rounds"], key=lambda r: int(r["round"]))]
    first, later = ref[0], statistics.median(ref[1:]) if len(ref) > 1 else ref[0]
    n = len(clients)
    net = star_network(clients, latency_s)
    shared = _server_link(server or LinkRates(), latency_s)
    times, transfer_total, fab_s = [], 0.0, 0.0
    for index, record in enumerate(rounds):
        up = wire_factor * int(record["bytes_up"])
        down = wire_factor * int(record["bytes_down"])
        up_s = _star_transfer(net, shared, n, up, upward=True)
        down_s = _star_transfer(net, shared, n, down, upward=False)
        if index:
            up_s = max(0.0, up_s - float(floor.get("up", 0.0)))
            down_s = max(0.0, down_s - float(floor.get("down", 0.0)))
        transfer = up_s + down_s
        if index == 0 and fab_bytes:
            fab_s = _star_transfer(net, shared, n, n * wire_factor * fab_bytes, upward=False)
            transfer += fab_s
        transfer_total += transfer
        times.append((first if index == 0 else later) + transfer)
    reached = None
    if target is not None:
        elapsed = 0.0
        for record, seconds in zip(rounds, times, strict=True):
            elapsed += seconds
            if record["accuracy"] is not None and float(record["accuracy"]) >= target:
                reached = elapsed
                break
    return {
        "round_s": times,
        "compute_s": {"round1": first, "median_later": later},
        "transfer_s": transfer_total,
        "fab_s": fab_s,
        "total_s": sum(times),
        "wire_factor": wire_factor,
        "time_to_target_s": reached,
        "transfer_floor_s": dict(floor) if floor else None,
    }


def transfer_floor(reference: Mapping[str, Any], samples: Sequence[Sequence[float]],
                   clients: int) -> dict[str, float]:
    """Seconds the unlimited ``reference``'s transfers took, per direction (``up``, ``down``).

    The median over its rounds after the first of the span from the first of the
    ``clients`` SuperNodes to start a transfer to the last to end one
    (:func:`fedddl.testbed.activity.round_activity` of its activity ``samples``).
    """
    rounds = rounds_activity(reference, samples, clients=clients)[1:]
    if not rounds:
        raise ValueError("the reference has no round after the first with activity samples")
    return {direction: statistics.median(r["transfer_span_s"][key] for r in rounds)
            for direction, key in (("up", "upload"), ("down", "download"))}


def _server_link(server: LinkRates, latency_s: float) -> NetworkModel:
    """Two-node network: the SuperLink (node 0) and everyone beyond its access link (node 1)."""
    big = 1e12
    return NetworkModel([[0.0, latency_s], [latency_s, 0.0]],
                        [[big, server.uplink_Bps or big], [server.downlink_Bps or big, big]],
                        name="server-link")


def _star_transfer(net: NetworkModel, shared: NetworkModel, n: int, total: float,
                   *, upward: bool) -> float:
    """Seconds to move ``total`` bytes split evenly over ``n`` clients to (``upward``) or from
    the server: the slowest client's own link, or the server's link carrying all of it."""
    if not total:
        return 0.0
    server = n
    each = round(total / n)
    if upward:
        own = max(net.transfer_time(i, server, each) for i in range(n))
        return max(own, shared.transfer_time(1, 0, round(total)))
    own = max(net.transfer_time(server, i, each) for i in range(n))
    return max(own, shared.transfer_time(0, 1, round(total)))


def message_overhead(result: Mapping[str, Any], network: NetworkModel) -> float:
    """Mean seconds by which the peers' measured model transfers exceed the model's time.

    Weighted by the number of models sent on each link; a model message has the
    size the peers sent on average.
    """
    nodes = result["nodes"]
    size = sum(int(m["bytes_sent"]) for m in nodes) / max(1, sum(int(m["sent"]) for m in nodes))
    excess, count = 0.0, 0
    for m in nodes:
        i = int(m["node_id"])
        for peer, seconds in m["mean_transfer_s"].items():
            sent = int(m["sent_to"].get(peer, 0))
            excess += sent * (float(seconds) - network.transfer_time(i, int(peer), round(size)))
            count += sent
    return excess / count if count else 0.0


def predict_gossip(
    result: Mapping[str, Any], network: str, *, eval_interval_s: float | None = None,
    seed: int = 0, message_overhead_s: float = 0.0, downlink_holds_latency: bool = True,
    stop_at_target: bool = False,
) -> dict[str, Any]:
    """Run the gossip simulator for the configuration of a testbed gossip ``result``.

    The compute time per step is the peers' mean measured time per step (pacing
    included) without the time spent waiting for sends (classic gossip waits
    after every step; the simulator adds that wait itself); the simulated span is
    1.5x the measured duration. ``message_overhead_s`` is added to every link's latency;
    ``downlink_holds_latency`` is passed to the simulator. Peers that sent compressed
    differences (``compressor`` in the configuration) are simulated with the same
    compressor, consensus step and scale buckets.

    ``eval_interval_s`` (virtual seconds between the simulator's evaluations of every
    node): by default as often as the peers' own curve gained a point, ``eval-every`` x
    the step time / nodes, and at least every 0.25 s (a large model evaluated every 0.25 s
    would cost more than its training). ``stop_at_target``: end the simulation when the
    mean accuracy first reaches the target (its message count then runs to that point).
    """
    from fedddl.gossip import run_gossip
    from fedddl.network import load_network

    cfg = result["config"]
    nodes = int(cfg["nodes"])
    step_s = statistics.mean(
        1.0 / float(m["steps_per_s"]) - float(m.get("ship_wait_s", 0.0)) / int(m["steps"])
        for m in result["nodes"]
    )
    if eval_interval_s is None:
        eval_interval_s = max(0.25, int(cfg.get("eval-every", 10)) * step_s / nodes)
    config = {
        "scheduler": cfg["scheduler"],
        "overlap": bool(cfg["overlap"]),
        "network": network,
        "nodes": nodes,
        "dataset": str(cfg.get("dataset", "digits")),
        "data_root": str(cfg.get("data-root", "")) or None,
        "partition": str(cfg.get("partition", "stratified")),
        "arch": str(cfg.get("arch", "")) or None,
        "target_accuracy": float(cfg["target_accuracy"]),
        "max_virtual_time_s": 1.5 * float(result["duration_s"]),
        "seed": seed,
        "lr": float(cfg.get("learning-rate", 0.1)),
        "batch_size": int(cfg.get("batch-size", 32)),
        "compute_time_s": step_s,
        "eval_interval_s": eval_interval_s,
        "eval_samples": int(cfg.get("eval-samples", 0)),
        "downlink_holds_latency": downlink_holds_latency,
        "stop_at_target": stop_at_target,
        **_compression(cfg),
    }
    if not message_overhead_s:
        sim = run_gossip(config)
    else:
        data = load_network(network, nodes, seed=seed).to_dict()
        data["latency_s"] = [
            [0.0 if i == j else float(lat) + message_overhead_s for j, lat in enumerate(row)]
            for i, row in enumerate(data["latency_s"])
        ]
        with tempfile.TemporaryDirectory(prefix="fedddl-net-") as tmp:
            path = Path(tmp) / "network-plus-overhead.json"
            path.write_text(json.dumps(data))
            sim = run_gossip({**config, "network": str(path)})
    sim["compute_time_s"] = step_s
    sim["message_overhead_s"] = message_overhead_s
    sim["downlink_holds_latency"] = downlink_holds_latency
    sim["eval_interval_s"] = eval_interval_s
    sim["stop_at_target"] = stop_at_target
    return sim


def _compression(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The simulator's compression keys for the peers' ``--compressor`` options (none: fp32);
    an option the peers were not given is their default, which they take from
    :class:`~fedddl.gossip.sim_config.GossipConfig`."""
    from fedddl.gossip.sim_config import GossipConfig

    if not cfg.get("compressor"):
        return {}
    return {"compressor": str(cfg["compressor"]),
            "consensus_step": float(cfg.get("consensus-step", GossipConfig.consensus_step)),
            "scale_bucket": int(cfg.get("scale-bucket", GossipConfig.scale_bucket))}


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """``measured / predicted``, or None when either is missing."""
    if measured is None or predicted is None or predicted <= 0:
        return None
    return measured / predicted
