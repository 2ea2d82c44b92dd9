"""Side-by-side testbed runs with their predictions: what ``fedddl testbed flower|gossip`` run.

:func:`flower_matrix` starts one deployment and, for each repetition, runs every
strategy on unlimited links (the reference that measures compute) and then on
each network, interleaved, so compared runs share processes and machine load.
:func:`gossip_matrix` runs each gossip variant on the testbed and the gossip
simulator on the same profile. Both write every result JSON (with its
``prediction``) and a ``summary.md`` / ``summary.json`` of measured vs predicted
time to target.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedddl.deploy.processes import DeploymentError
from fedddl.network import NetworkModel
from fedddl.testbed.flower_run import FlowerTestbed, RunTimeout, activity_path, time_to_target
from fedddl.testbed.gossip_run import run_gossip_testbed
from fedddl.testbed.netns import LinkRates
from fedddl.testbed.predict import (
    message_overhead,
    predict_flower,
    predict_gossip,
    ratio,
    transfer_floor,
)

__all__ = ["client_rates", "flower_links", "flower_matrix", "gossip_matrix",
           "run_once_more_on_failure"]

#: label, scheduler, overlap, more peer options of this variant (e.g. its compressor)
GossipVariant = tuple[str, str, bool, Mapping[str, str | int | float]]


def client_rates(network: NetworkModel) -> list[LinkRates]:
    """SuperNode access links from a profile: node ``i``'s uplink is its fastest outgoing
    link, its downlink the fastest incoming one (exact for homogeneous profiles)."""
    bw = network.bandwidth_Bps
    n = network.num_nodes
    return [
        LinkRates(
            uplink_Bps=max(float(bw[i, j]) for j in range(n) if j != i),
            downlink_Bps=max(float(bw[j, i]) for j in range(n) if j != i),
        )
        for i in range(n)
    ]


def flower_links(network: NetworkModel, supernodes: int) -> tuple[list[LinkRates], LinkRates]:
    """SuperNode and SuperLink access links of a Flower profile.

    A profile of ``supernodes`` nodes shapes the SuperNodes' links only (the SuperLink's is
    unlimited); one of ``supernodes + 1`` nodes also shapes the SuperLink's (its last node),
    so every SuperNode's traffic shares that link (:func:`client_rates` for each node).

    Raises
    ------
    ValueError
        If the profile has neither ``supernodes`` nor ``supernodes + 1`` nodes.
    """
    rates = client_rates(network)
    if len(rates) == supernodes:
        return rates, LinkRates()
    if len(rates) == supernodes + 1:
        return rates[:-1], rates[-1]
    raise ValueError(f"profile {network.name!r} has {len(rates)} nodes; a Flower testbed of "
                     f"{supernodes} SuperNodes takes {supernodes} (clients) or "
                     f"{supernodes + 1} (clients, then the SuperLink)")


def _save(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def _fmt(value: float | None, digits: int = 1) -> str:
    return "not reached" if value is None else f"{value:.{digits}f}"


def run_once_more_on_failure(run: Callable[[], dict[str, Any]], name: str) -> dict[str, Any]:
    """``run()``, and once more if it raises :class:`DeploymentError`.

    Flower's SuperLink now and then ends a run while its ServerApp is still working
    (its log then shows "Runtime task-token authentication failed" and the SuperNodes'
    replies are refused with "Run is finished"); the run wrote no results, so running it
    again loses nothing. A second failure is raised, and so is a :class:`RunTimeout` at once
    (a run past its time bound would only be stopped at it again).
    """
    try:
        return run()
    except RunTimeout:
        raise
    except DeploymentError as error:
        first = str(error).splitlines()[0]
        print(f"fedddl testbed: {name} failed ({first}); running it once more",
              file=sys.stderr, flush=True)
        return run()


def flower_matrix(
    *,
    supernodes: int,
    networks: Sequence[tuple[str, NetworkModel]],
    strategies: Sequence[str],
    run_config: Mapping[str, str | int | float | bool],
    target: float,
    repeats: int,
    out_dir: str | os.PathLike[str],
    app_dir: str | os.PathLike[str],
    tls: bool = True,
    resume: bool = False,
    reference_rounds: int | None = None,
    heartbeat_patience: int | None = None,
    run_timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """Run every (repetition, network, strategy) on one deployment; return the summary rows.

    With ``resume``, a run whose results file exists in ``out_dir`` is read instead
    of run again (e.g. the unlimited references of an earlier call). ``reference_rounds``
    (at least 2) replaces ``num-server-rounds`` in the unlimited reference runs only: the
    prediction takes just their round 1 and the median of their later rounds.
    ``heartbeat_patience`` is passed to :class:`FlowerTestbed`; each run is stopped after
    ``run_timeout_s`` seconds (:class:`RunTimeout`, not run again).
    """
    if reference_rounds is not None and reference_rounds < 2:
        raise ValueError(f"reference_rounds must be >= 2, got {reference_rounds}")
    if not run_timeout_s > 0:
        raise ValueError(f"run_timeout_s must be > 0, got {run_timeout_s}")
    out = Path(out_dir)
    unlimited = [LinkRates()] * supernodes
    links = [("unlimited", (unlimited, LinkRates()))] + [
        (name, flower_links(net, supernodes)) for name, net in networks]
    latency = {name: float(net.latency_s.max()) for name, net in networks}
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        bed: FlowerTestbed | None = None  # started at the first run that is not resumed
        for rep in range(repeats):
            references: dict[str, dict[str, Any]] = {}
            for link, (rates, server) in links:
                for strategy in strategies:
                    name = f"{link}-{strategy}-rep{rep}"
                    done = out / f"{name}.json"
                    if resume and done.exists():
                        result = json.loads(done.read_text())
                    else:
                        if bed is None:
                            bed = stack.enter_context(
                                FlowerTestbed(unlimited, out / "deployment", app_dir, tls=tls,
                                              heartbeat_patience=heartbeat_patience))
                        bed.set_client_rates(rates)
                        bed.set_server_rates(server)
                        config = {**run_config, "strategy": strategy}
                        if link == "unlimited" and reference_rounds is not None:
                            config["num-server-rounds"] = reference_rounds
                        attempt = functools.partial(bed.run, config, name, target=target,
                                                    timeout_s=run_timeout_s)
                        result = run_once_more_on_failure(attempt, name)
                    result["testbed"].update(network=link, target=target,
                                             time_to_target_s=time_to_target(result, target))
                    if link == "unlimited":
                        references[strategy] = result
                    reference = references[strategy]
                    predict = functools.partial(
                        predict_flower, result, reference, rates,
                        fab_bytes=int(result["testbed"]["app_bytes"]["fab_per_supernode"]),
                        target=target, server=server)
                    floor = _reference_floor(out, reference, supernodes)
                    prediction = predict(transfer_floor_s=floor)
                    if floor is not None:  # the model without the floor, for comparison
                        prediction["additive_round_s"] = predict()["round_s"]
                    prediction["profile_latency_s_not_emulated"] = latency.get(link, 0.0)
                    result["prediction"] = prediction
                    _save(out / f"{name}.json", result)
                    rows.append(_flower_row(result, prediction, strategy, link, rep))
    _write_summary(out, rows, _FLOWER_COLUMNS, "Flower deployment on the testbed")
    return rows


def _reference_floor(out: Path, reference: Mapping[str, Any],
                     supernodes: int) -> dict[str, float] | None:
    """:func:`transfer_floor` of the unlimited ``reference``, if its activity was sampled."""
    name = reference.get("testbed", {}).get("name")
    activity = activity_path(out / "deployment", str(name))
    rounds = reference["rounds"]
    if name is None or not activity.exists() or len(rounds) < 2 or "started_at" not in rounds[1]:
        return None
    return transfer_floor(reference, json.loads(activity.read_text())["samples"], supernodes)


def _flower_row(result: Mapping[str, Any], prediction: Mapping[str, Any], strategy: str,
                link: str, rep: int) -> dict[str, Any]:
    section = result["testbed"]
    rounds = result["rounds"]
    app = section["app_bytes"]
    wire = section["wire"]
    measured = section["time_to_target_s"]
    median_round = statistics.median(float(r["wall_s"]) for r in rounds)
    return {
        "network": link,
        "strategy": strategy,
        "rep": rep,
        "rounds": len(rounds),
        "final_accuracy": result["final_accuracy"],
        "app_MB_per_round": (app["up"] + app["down"]) / len(rounds) / 1e6,
        "wire_MB": (wire["tx_bytes"] + wire["rx_bytes"]) / 1e6,
        "median_round_s": median_round,
        "predicted_median_round_s": statistics.median(prediction["round_s"]),
        "ratio_median_round": ratio(median_round,
                                    statistics.median(prediction["round_s"])),
        "rounds_s": sum(float(r["wall_s"]) for r in rounds),
        "predicted_rounds_s": prediction["total_s"],
        "time_to_target_s": measured,
        "predicted_time_to_target_s": prediction["time_to_target_s"],
        "ratio": ratio(measured, prediction["time_to_target_s"]),
        "ratio_all_rounds": ratio(sum(float(r["wall_s"]) for r in rounds), prediction["total_s"]),
        "transfer_floor_s": _floor_text(prediction.get("transfer_floor_s")),
        "ratio_additive": ratio(median_round, statistics.median(prediction["additive_round_s"]))
        if prediction.get("additive_round_s") else None,
        "load_avg": section["load_avg_before"][0],
    }


_FLOWER_COLUMNS = [
    ("network", "link"), ("strategy", "strategy"), ("rep", "rep"),
    ("final_accuracy", "final acc"), ("app_MB_per_round", "app MB/round"),
    ("wire_MB", "wire MB (all)"), ("median_round_s", "median round s"),
    ("predicted_median_round_s", "predicted median round s"),
    ("ratio_median_round", "median round measured/predicted"),
    ("time_to_target_s", "measured s to target"),
    ("predicted_time_to_target_s", "predicted s"), ("ratio", "measured/predicted"),
    ("rounds_s", "measured s, all rounds"), ("predicted_rounds_s", "predicted s, all rounds"),
    ("ratio_all_rounds", "ratio, all rounds"),
    ("transfer_floor_s", "reference transfer s (up/down)"),
    ("ratio_additive", "median round measured/predicted without it"), ("load_avg", "load (1 min)"),
]


def _floor_text(floor: Mapping[str, float] | None) -> str:
    return "-" if not floor else f"{floor['up']:.1f}/{floor['down']:.1f}"


def gossip_matrix(
    *,
    network_spec: str,
    nodes: int,
    variants: Sequence[GossipVariant],
    peer_options: Mapping[str, str | int | float],
    target: float,
    repeats: int,
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    predict: bool = True,
    resume: bool = False,
    predict_to_target: bool = False,
) -> list[dict[str, Any]]:
    """Run each gossip variant on the testbed (and the simulator); return the summary rows.

    With ``resume``, a variant whose results file exists in ``out_dir`` is read instead of
    run again (with the prediction it was saved with; one saved without is predicted now).
    """
    from fedddl.network import load_network

    out = Path(out_dir)
    network = load_network(network_spec, nodes, seed=seed)
    rows: list[dict[str, Any]] = []
    for rep in range(repeats):
        for label, scheduler, overlap, extra_options in variants:
            name = f"{label}-rep{rep}"
            done = out / f"{name}.json"
            if resume and done.exists():
                result = json.loads(done.read_text())
            else:
                result = run_gossip_testbed(
                    network, out / name, scheduler=scheduler, overlap=overlap, target=target,
                    peer_options={"seed": seed, **peer_options, **extra_options},
                )
                _save(done, result)  # kept even if the simulator fails below
            if predict and "prediction" not in result:
                _predict_gossip_both_ways(result, network, network_spec, seed,
                                          to_target=predict_to_target)
                _save(done, result)
            overhead = message_overhead(result, network)
            sims = [result[k] for k in ("prediction", "prediction_corrected") if k in result]
            predicted = sims[0]["time_to_target_s"] if sims else None
            corrected = sims[1]["time_to_target_s"] if len(sims) > 1 else None
            rows.append({
                "variant": label, "rep": rep,
                "final_accuracy": result["final_accuracy"],
                "step_s": sum(1 / s for s in result["steps_per_s"]) / nodes,
                "messages": result["messages"],
                "app_MB": result["bytes_total"] / 1e6,
                "wire_MB": result["testbed"]["wire_tx_bytes"] / 1e6,
                "time_to_target_s": result["time_to_target_s"],
                "predicted_time_to_target_s": predicted,
                "ratio": ratio(result["time_to_target_s"], predicted),
                "predicted_messages": sims[0]["messages"] if sims else None,
                "message_overhead_ms": 1000 * overhead,
                "corrected_time_to_target_s": corrected,
                "corrected_ratio": ratio(result["time_to_target_s"], corrected),
                "corrected_messages": sims[1]["messages"] if len(sims) > 1 else None,
                "load_avg": result["testbed"]["load_avg_after"][0],
            })
    _write_summary(out, rows, _GOSSIP_COLUMNS, f"Gossip peers on the testbed ({network.name})")
    return rows


def _predict_gossip_both_ways(result: dict[str, Any], network: NetworkModel, network_spec: str,
                              seed: int, *, to_target: bool = False) -> None:
    """Add the simulator as published and corrected (:mod:`fedddl.testbed.predict`)."""
    sims = []
    for extra, held in ((0.0, True), (message_overhead(result, network), False)):
        sim = predict_gossip(result, network_spec, seed=seed, message_overhead_s=extra,
                             downlink_holds_latency=held, stop_at_target=to_target)
        sims.append({k: sim[k] for k in (
            "time_to_target_s", "curve", "messages", "bytes_total", "final_accuracy",
            "compute_time_s", "stale_merges", "message_overhead_s", "downlink_holds_latency",
            "eval_interval_s", "stop_at_target")})
    result["prediction"], result["prediction_corrected"] = sims


_GOSSIP_COLUMNS = [
    ("variant", "variant"), ("rep", "rep"), ("final_accuracy", "final acc"),
    ("step_s", "s/step"), ("messages", "models sent"), ("app_MB", "app MB"),
    ("wire_MB", "wire MB"), ("time_to_target_s", "measured s to target"),
    ("predicted_time_to_target_s", "simulator s"), ("ratio", "measured/simulated"),
    ("predicted_messages", "simulator models sent"),
    ("message_overhead_ms", "measured overhead/message (ms)"),
    ("corrected_time_to_target_s", "corrected simulator s"),
    ("corrected_ratio", "measured/corrected"),
    ("corrected_messages", "corrected simulator models sent"), ("load_avg", "load (1 min)"),
]


def _write_summary(out: Path, rows: list[dict[str, Any]],
                   columns: Sequence[tuple[str, str]], title: str) -> None:
    _save(out / "summary.json", rows)
    lines = [f"# {title}", "", "| " + " | ".join(h for _, h in columns) + " |",
             "|" + " --- |" * len(columns)]
    for row in rows:
        cells = []
        for key, _ in columns:
            value = row[key]
            if isinstance(value, float) or value is None:
                digits = 3 if key in ("final_accuracy", "app_MB_per_round", "step_s") else 2
                cells.append(_fmt(value, digits))
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
