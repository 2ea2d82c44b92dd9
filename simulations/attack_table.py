"""Final accuracy under attack, per aggregator: the tables of docs/untrusted-clients.md.

Runs the real ServerApp loop and ClientApps (honest and malicious) of ``fedddl simulate``
(digits, 10 clients, stratified shards, the default TernGrad settings) once per cell, writes
every results JSON to ``--out`` (a cell whose JSON exists is not run again, so an
interrupted table resumes) and prints the Markdown tables::

    python -m simulations.attack_table --rounds 100 --out results/attacks

By default each cell runs in this process on the inline engine of ``fedddl simulate
--engine inline`` (every node's ClientApp called in turn, with its own state, exactly the
messages of a simulation); ``--ray`` runs each cell as ``fedddl simulate`` on Ray in its
own process instead (same apps, Ray actors, slower to start).

Columns: ``plain mean`` is the mean without the scale bound, the direction check, the norm
clip and the resync rate limit (``--scale-bound 0 --direction-check 0 --norm-clip 0
--resync-interval 0``; malformed
metrics and payloads whose header does not fit the model are refused whatever the
settings); ``mean`` is the default; then each robust aggregator with the default bound
and direction check. Model-poisoning attacks run in every
column; attacks the screening refuses whatever the aggregator (bad metrics, oversized
payloads) run with the default and one attacker only; the bandwidth attacks run plain and
default, and their table shows bytes and replica agreement.

``--path dropin`` runs the drop-in layer instead (``TernaryDelta(FedAvg)`` and
``TernaryDelta(FedMedian)`` + ``ternary_mod``, one attacker of 10:
:mod:`simulations.attack_dropin`); ``--path gossip`` one compromised gossip peer of 8 on
the simulator, merge clip off and on (:func:`simulations.gossip_compromised.simulate`)::

    python -m simulations.attack_table --path dropin --rounds 30 --out results/attacks
    python -m simulations.attack_table --path gossip --out results/attacks
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Each column's run-config keys (``fedddl simulate --KEY VALUE`` for the Ray runs).
COLUMNS: dict[str, dict[str, Any]] = {
    "plain mean": {
        "scale-bound": 0.0, "resync-interval": 0, "direction-check": 0.0, "norm-clip": 0.0,
    },
    "mean": {},
    "median": {"aggregator": "median"},
    "trimmed-mean": {"aggregator": "trimmed-mean"},
    "sign-vote": {"aggregator": "sign-vote"},
}
POISONING = ["scale:1e6", "scale:1e30", "sign-flip", "all-plus", "near-bound:7.9", "adaptive:7.9"]
# Forged BatchNorm statistics: rows only for a model with BatchNorm (``--arch resnet8``).
STATISTICS = ["bn-statistics:2", "bn-statistics:7.9"]
REFUSED = ["nan-metrics", "inf-metrics", "huge-examples", "many-tensors"]
BANDWIDTH = ["resync-spam", "fingerprint-lie"]
ATTACKERS = (1, 3)
CLIENTS = 10
# The gossip rows: attacks ('' clean) and message kinds ('' fp32) of one compromised peer.
GOSSIP_ATTACKS = ("", "constant", "scaled-initial")
GOSSIP_COMPRESSORS = ("", "ternary-base3")


def cells(statistics: bool = False) -> list[tuple[str, int, str]]:
    """Every ``(attack, attackers, column)`` of the tables (attack '' is the clean run);
    ``statistics``: with the :data:`STATISTICS` rows (one attacker, every column)."""
    out = [("", 0, column) for column in COLUMNS]
    for attack in POISONING:
        out += [(attack, n, column) for n in ATTACKERS for column in COLUMNS]
    for attack in STATISTICS if statistics else ():
        out += [(attack, 1, column) for column in COLUMNS]
    for attack in REFUSED:  # refused by the screening whatever the aggregator or the count
        out += [(attack, 1, "mean")]
    for attack in BANDWIDTH:
        out += [(attack, n, column) for n in ATTACKERS for column in ("plain mean", "mean")]
    return out


def _name(attack: str, attackers: int, column: str) -> str:
    return f"{attack or 'clean'}-{attackers}-{column.replace(' ', '_')}.json".replace(":", "_")


def run_config(
    attack: str,
    attackers: int,
    column: str,
    rounds: int,
    downlink: str = "reternarize",
    arch: str = "",
    scale_bucket: str = "",
    seed: int = 0,
) -> dict[str, Any]:
    """One cell's run-config keys (and ``num-clients``), as ``fedddl simulate`` takes them
    (``arch`` and ``scale_bucket`` only when given)."""
    return {
        "num-clients": CLIENTS, "num-server-rounds": rounds, "dataset": "digits",
        **({"arch": arch} if arch else {}),
        **({"scale-bucket": scale_bucket} if scale_bucket else {}),
        "partition": "stratified", "seed": seed, "downlink": downlink,
        "attack": attack, "num-attackers": attackers, **COLUMNS[column],
    }  # fmt: skip


def simulate_flags(keys: dict[str, Any]) -> list[str]:
    """``fedddl simulate`` arguments for run-config ``keys`` (``--KEY VALUE``; the rounds
    are ``--rounds``; no attack: no attack flags)."""
    flags: list[str] = []
    for key, value in keys.items():
        if key in ("attack", "num-attackers") and not keys["attack"]:
            continue
        flags += ["--rounds" if key == "num-server-rounds" else f"--{key}", str(value)]
    return flags


def run_inline(
    attack: str,
    attackers: int,
    column: str,
    rounds: int,
    downlink: str = "reternarize",
    arch: str = "",
    scale_bucket: str = "",
    seed: int = 0,
) -> dict[str, Any]:
    """One cell on the inline engine (no Ray): the results dict of the ServerApp loop."""
    import torch

    from simulations.tool_runners import run_simulate_inline

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # per-round logs of 10 clients x many cells: the JSON has them
    keys = run_config(attack, attackers, column, rounds, downlink, arch, scale_bucket, seed)
    return run_simulate_inline(keys)


def run_cell(
    attack: str,
    attackers: int,
    column: str,
    rounds: int,
    out: Path,
    extra: list[str] | None,
    downlink: str = "reternarize",
    arch: str = "",
    scale_bucket: str = "",
    seed: int = 0,
) -> dict[str, Any]:
    """Run (or read back) one cell's simulation (``extra`` None: in-process, else the
    extra ``fedddl simulate`` arguments of a Ray run)."""
    path = out / _name(attack, attackers, column)
    if extra is None:
        if not path.exists():
            start = time.perf_counter()
            data = run_inline(
                attack, attackers, column, rounds, downlink, arch, scale_bucket, seed
            )
            data["runtime_s"] = time.perf_counter() - start
            path.write_text(json.dumps(data, indent=1, allow_nan=False))
            print(f"{path.name}: {data['final_accuracy']:.4f} in {data['runtime_s']:.0f} s")
        result: dict[str, Any] = json.loads(path.read_text())
        return result
    for _ in range(2):  # once more if no client ever answered (Ray failed to start)
        if path.exists() and _no_client_answered(json.loads(path.read_text())):
            print(f"{path.name}: no client answered (Ray did not start?), running again")
            path.unlink()
        if path.exists():
            break
        command = [
            sys.executable, "-m", "fedddl", "simulate", "--strategy", "terngrad", "--quiet",
            "--out", str(path), *simulate_flags(run_config(attack, attackers, column, rounds,
                                                           downlink, arch, scale_bucket,
                                                           seed)),
            *extra,
        ]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        data = json.loads(path.read_text())
        data["runtime_s"] = time.perf_counter() - start
        path.write_text(json.dumps(data, indent=1))
        accuracy, runtime = data["final_accuracy"], data["runtime_s"]
        print(f"{path.name}: {accuracy:.4f} in {runtime:.0f} s", flush=True)
    result = json.loads(path.read_text())
    return result


def _no_client_answered(result: dict[str, Any]) -> bool:
    return bool(result["rounds"]) and all(r["messages_up"] == 0 for r in result["rounds"])


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}"


def tables(results: dict[tuple[str, int, str], dict[str, Any]], rounds: int, arch: str = "") -> str:
    """The Markdown tables of the results."""
    model = f", {arch}" if arch else ""
    lines = [
        f"Final accuracy (%) after {rounds} rounds, digits{model}, 10 clients:",
        "",
        "| attack | attackers | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    rows = [("", 0)] + [(a, n) for a in POISONING for n in ATTACKERS]
    rows += [(a, 1) for a in STATISTICS] + [(a, 1) for a in REFUSED]
    for attack, attackers in rows:
        row = [
            _pct(results[(attack, attackers, c)]["final_accuracy"])
            if (attack, attackers, c) in results
            else ""
            for c in COLUMNS
        ]
        lines.append(f"| {attack or 'none'} | {attackers} | " + " | ".join(row) + " |")
    lines += [
        "",
        "Bandwidth attacks (bytes down per round, means over the rounds; x: ratio to the clean",
        "run with the same column's settings):",
        "",
        "| attack | attackers | column | accuracy % | server, all clients | per honest client "
        "| per attacker | honest replicas equal in every round | resyncs held back |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for attack, attackers, column in [("", 0, "plain mean"), ("", 0, "mean")] + [
        (a, n, c) for a in BANDWIDTH for n in ATTACKERS for c in ("plain mean", "mean")
    ]:
        result, clean = results.get((attack, attackers, column)), results.get(("", 0, column))
        if result is None or clean is None:
            continue
        s, c = result["summary"], clean["summary"]
        honest = CLIENTS - attackers
        per_clean = c["mean_bytes_down"] / CLIENTS
        per_honest = s.get("mean_bytes_down_honest", s["mean_bytes_down"]) / honest
        per_attacker = s["mean_bytes_down_attackers"] / attackers if attackers else None
        equal = s.get("replicas_equal_honest_all", s["replicas_equal_all"])
        lines.append(
            f"| {attack or 'none'} | {attackers} | {column} | {_pct(s['final_accuracy'])} "
            f"| {s['mean_bytes_down']:,.0f} ({s['mean_bytes_down'] / c['mean_bytes_down']:.2f}x) "
            f"| {per_honest:,.0f} ({per_honest / per_clean:.2f}x) "
            f"| {'—' if per_attacker is None else f'{per_attacker:,.0f}'} "
            f"| {equal} | {s['resync_limited']} |"
        )
    return "\n".join(lines)


def _cached(path: Path, run: Any) -> dict[str, Any]:
    """``run()``'s result, written to ``path`` as JSON (read back if ``path`` exists)."""
    if not path.exists():
        path.write_text(json.dumps(run(), indent=1, allow_nan=False))
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def dropin_results(
    rounds: int,
    out: Path,
    attacks: list[str] | None = None,
    wrapped: tuple[str, ...] = ("fedavg", "fedmedian"),
    clients: int = CLIENTS,
) -> list[dict[str, Any]]:
    """The drop-in rows (:func:`simulations.attack_dropin.run_dropin`), one JSON each."""
    from simulations.attack_dropin import ATTACKS, run_dropin

    rows = []
    for name in wrapped:
        for attack in attacks if attacks is not None else list(ATTACKS):
            stem = f"dropin-{name}-{attack or 'clean'}-{clients}-{rounds}"
            path = out / f"{stem}.json".replace(":", "_")
            rows.append(_cached(path, lambda a=attack, n=name: run_dropin(a, n, rounds, clients)))
            print(f"{path.name}: {rows[-1]['final_accuracy']}", file=sys.stderr)
    return rows


def dropin_table(rows: list[dict[str, Any]], rounds: int) -> str:
    """The drop-in rows' Markdown table, with its heading line."""
    from simulations.attack_dropin import table

    clients = rows[0]["clients"] if rows else CLIENTS
    return (
        f"The drop-in layer, one attacker of {clients}: final accuracy (%) after {rounds} "
        f"rounds, digits, {clients} clients:\n\n" + table(rows)
    )


def gossip_results(
    out: Path,
    seconds: float = 20.0,
    seeds: tuple[int, ...] = (0,),
    compressors: tuple[str, ...] = GOSSIP_COMPRESSORS,
) -> list[dict[str, Any]]:
    """The gossip rows: one compromised peer of 8 on the simulator, clip off and on."""
    from fedddl.gossip.clip import DEFAULT_CLIP
    from simulations.gossip_compromised import simulate

    rows = []
    for compressor in compressors:
        for attack in GOSSIP_ATTACKS:
            for clip in (0.0, DEFAULT_CLIP):
                for seed in seeds:
                    name = f"gossip-{compressor or 'fp32'}-{attack or 'clean'}-{clip:g}-{seed}"
                    path = out / f"{name}-{seconds:g}s.json"
                    result = _cached(path, lambda a=attack, c=clip, s=seed, m=compressor:
                                     simulate(s, c, a, m, seconds))  # fmt: skip
                    rows.append({"where": "sim", "compressor": compressor or "fp32",
                                 "attack": attack or "clean", "clip": clip, "seed": seed,
                                 **result})  # fmt: skip
    return rows


def main() -> int:
    """Run the missing cells, then print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--out", default="results/attacks")
    parser.add_argument(
        "--cpus-per-client", default="2", help="Ray CPUs per client (2 on 2 cores: one actor)"
    )
    parser.add_argument("--tables-only", action="store_true", help="print what exists")
    parser.add_argument("--ray", action="store_true", help="each cell as fedddl simulate (Ray)")
    parser.add_argument("--downlink", default="reternarize", help="the run's downlink")
    parser.add_argument(
        "--arch", default="", help="the model (e.g. resnet8: adds the bn-statistics rows)"
    )
    parser.add_argument(
        "--attacks", default="", help="comma-separated attacks to run ('none': clean; '': all)"
    )
    parser.add_argument("--columns", default="", help="comma-separated columns to run ('': all)")
    parser.add_argument(
        "--attackers", default="", help="comma-separated attacker counts to run ('': 1 and 3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (use its own --out)")
    parser.add_argument(
        "--scale-bucket", default="", help="the run's scale-bucket ('': the default, 'auto')"
    )
    parser.add_argument(
        "--path",
        choices=("terngrad", "dropin", "gossip"),
        default="terngrad",
        help="TernGrad's server, the drop-in layer, or gossip peers",
    )
    parser.add_argument("--virtual-s", type=float, default=20.0, help="gossip: virtual seconds")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.path != "terngrad":
        import torch

        torch.set_num_threads(1)
        logging.disable(logging.WARNING)  # every dropped reply is logged; the JSON has them
        if args.path == "dropin":
            attacks = ([a if a != "none" else "" for a in args.attacks.split(",")]
                       if args.attacks else None)  # fmt: skip
            print(dropin_table(dropin_results(args.rounds, out, attacks), args.rounds))
        else:
            from simulations.gossip_compromised import table as gossip_table

            print(gossip_table(gossip_results(out, args.virtual_s)))
        return 0
    results = {}
    wanted = {a if a != "none" else "" for a in args.attacks.split(",")} if args.attacks else None
    for attack, attackers, column in cells(statistics=bool(args.arch)):
        if wanted is not None and attack not in wanted:
            continue
        if args.columns and column not in args.columns.split(","):
            continue
        if args.attackers and attackers and str(attackers) not in args.attackers.split(","):
            continue
        path = out / _name(attack, attackers, column)
        if args.tables_only and not path.exists():
            continue
        extra = ["--cpus-per-client", args.cpus_per_client] if args.ray else None
        results[(attack, attackers, column)] = run_cell(
            attack, attackers, column, args.rounds, out, extra, args.downlink, args.arch,
            args.scale_bucket, args.seed,
        )
    print(tables(results, args.rounds, args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
