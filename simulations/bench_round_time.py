"""Wall time of a simulated round: TernGrad against FedAvg (and GradientAverage), side by side.

Runs the same configuration with each strategy through ``fedddl simulate``'s Python API
(Flower's Ray simulation, one actor per ``--cpus-per-client`` CPUs), each run in a fresh
Python process, ``--repeats`` times, alternating which strategy goes first. It prints each
run's median round (round 1, which pays Ray's start-up, left out), median exchange (the
server's messages out to the last reply in), final accuracy and mean bytes per round, then
the medians over runs, the ratios to FedAvg and GradientAverage (same seed, same shards)
and, run by run, the ratio of TernGrad's median to the other strategy's in the same repeat.

With ``--interleave SECONDS`` a repeat starts every strategy's fresh process at once and
lets one run at a time (``SIGSTOP``/``SIGCONT`` to every process a run started, Ray workers
included, switching every SECONDS), so all strategies share the machine's slow and fast
phases; only rounds inside a slice count, and the ratio is also given *per cycle*. Linux only.
Why and the measurements: ``docs/round-time.md``.

    python -m simulations.bench_round_time --dataset digits --rounds 40
    python -m simulations.bench_round_time --rounds 2000 --repeats 1 --interleave 3 \
        --strategies terngrad,fedavg

The last lines read ``bytes per round (up + down): ...``, ``median round: terngrad A s,
fedavg B s, ... (terngrad/fedavg R, ...)``, ``median exchange: ...; rest of the round: ...``
and ``per repeat terngrad/fedavg: r1 r2 ... (TernGrad no slower in K of N)`` (with
``--interleave`` also ``per cycle terngrad/fedavg: median R (...)``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

STRATEGIES = ("terngrad", "fedavg", "gradient-average")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="dataset name (default: digits)")
    parser.add_argument("--arch", default="", help="model architecture (default: the dataset's)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds per run (default: 40)")
    parser.add_argument("--num-clients", type=int, default=10, help="clients (default: 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per strategy (default: 3)")
    parser.add_argument("--cpus-per-client", type=float, default=1.0,
                        help="Ray CPUs per client (default: 1, one actor per core)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every N rounds (default: 0, only the last round)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated subset to run (default: all three)")
    parser.add_argument("--eval-samples", type=int, default=0,
                        help="test samples per evaluation (default: 0, all)")
    parser.add_argument("--interleave", type=float, default=0.0, metavar="SECONDS",
                        help="run the strategies at once, one unpaused at a time, switching "
                             "every SECONDS (default: 0, one run after the other)")
    parser.add_argument("--one-run", help=argparse.SUPPRESS)  # the child of one run
    args = parser.parse_args(argv)
    if args.one_run is not None:
        return _one_run(args, args.one_run)
    chosen = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(chosen) - set(STRATEGIES))
    if unknown or "terngrad" not in chosen or len(chosen) < 2:
        parser.error(f"--strategies: terngrad and at least one of {STRATEGIES[1:]} "
                     f"(unknown: {unknown})")
    if args.interleave < 0 or (args.interleave and not hasattr(signal, "SIGSTOP")):
        parser.error("--interleave: a positive number of seconds, on Linux")

    medians: dict[str, list[float]] = {s: [] for s in chosen}
    exchanges: dict[str, list[float]] = {s: [] for s in chosen}
    traffic: dict[str, list[float]] = {s: [] for s in chosen}
    others = [s for s in chosen if s != "terngrad"]
    cycles: dict[str, list[float]] = {s: [] for s in others}
    for repeat in range(args.repeats):
        order = chosen if repeat % 2 == 0 else chosen[::-1]
        results: dict[str, dict[str, Any]] = {}
        took: dict[str, float] = {}
        if args.interleave:
            start = time.perf_counter()
            results, by_slice = _run_interleaved(argv, order, args.interleave, args.rounds)
            took = dict.fromkeys(order, time.perf_counter() - start)
            for other in others:
                cycles[other] += cycle_ratios(by_slice["terngrad"], by_slice[other])
        else:
            for strategy in order:
                start = time.perf_counter()
                results[strategy] = _run_in_fresh_process(argv, strategy)
                took[strategy] = time.perf_counter() - start
        for strategy in order:
            result = results[strategy]
            walls = result["walls"]
            medians[strategy].append(statistics.median(walls))
            exchanges[strategy].append(statistics.median(result["exchanges"]))
            traffic[strategy].append(result["bytes"])
            counted = f"{len(walls)} rounds counted, " if args.interleave else ""
            print(
                f"run {repeat + 1} {strategy:16s} median round {medians[strategy][-1]:.3f} s "
                f"(min {min(walls):.3f}, max {max(walls):.3f}; "
                f"exchange {exchanges[strategy][-1]:.3f} s; {counted}run {took[strategy]:.0f} s, "
                f"accuracy {result['final_accuracy']:.4f}, "
                f"{traffic[strategy][-1]:,.0f} B/round up + down)",
                flush=True,
            )
            curve = result["curve"]
            if len(curve) > 1:
                print("    accuracy by round: " + ", ".join(f"{n} {a:.4f}" for n, a in curve))
    overall = {s: statistics.median(v) for s, v in medians.items()}
    volume = {s: statistics.median(v) for s, v in traffic.items()}
    print(
        "bytes per round (up + down): "
        + ", ".join(f"{s} {volume[s]:,.0f}" for s in chosen)
        + " ("
        + ", ".join(f"{s}/terngrad {volume[s] / volume['terngrad']:.1f}x" for s in others)
        + ")"
    )
    print(
        "median round: "
        + ", ".join(f"{s} {overall[s]:.4f} s" for s in chosen)
        + " ("
        + ", ".join(f"terngrad/{s} {overall['terngrad'] / overall[s]:.3f}" for s in others)
        + ")"
    )
    rest = {s: statistics.median(m - e for m, e in zip(medians[s], exchanges[s], strict=True))
            for s in chosen}
    print(
        "median exchange: "
        + ", ".join(f"{s} {statistics.median(exchanges[s]):.4f} s" for s in chosen)
        + "; rest of the round: "
        + ", ".join(f"{s} {rest[s]:.4f} s" for s in chosen)
    )
    for other in others:
        pairs = [t / o for t, o in zip(medians["terngrad"], medians[other], strict=True)]
        print(
            f"per repeat terngrad/{other}: " + " ".join(f"{r:.3f}" for r in pairs)
            + f" (TernGrad no slower in {sum(r <= 1.0 for r in pairs)} of {len(pairs)})"
        )
    for other, ratios in cycles.items():
        if len(ratios) >= 2:
            low, _, high = statistics.quantiles(ratios, n=4)
            print(
                f"per cycle terngrad/{other}: median {statistics.median(ratios):.3f} "
                f"(quartiles {low:.3f}-{high:.3f}; TernGrad no slower in "
                f"{sum(r <= 1.0 for r in ratios)} of {len(ratios)} cycles)"
            )
    return 0


def _run_in_fresh_process(argv: list[str] | None, strategy: str) -> dict[str, Any]:
    """One run of ``strategy`` in a new Python process (this script with the same options
    and ``--one-run``); its round walls and exchanges, accuracy, bytes and accuracy curve."""
    with tempfile.TemporaryDirectory(prefix="bench-round-time-") as folder:
        child = _Child(_child_command(argv, strategy), strategy, Path(folder))
        child.process.wait()
        return child.result()


def _child_command(argv: list[str] | None, strategy: str) -> list[str]:
    """This script with the parent's options and ``--one-run strategy``."""
    options = sys.argv[1:] if argv is None else argv
    return [sys.executable, __file__, *options, "--one-run", strategy]


#: The environment variable carrying a run's token: every process an interleaved run
#: starts (its Ray processes included) inherits it, so pausing finds them all by pid.
TOKEN_ENV = "FEDDDL_BENCH_RUN"
_ROUND = "BENCH-ROUND "
_START_TIMEOUT_S = 900.0


class Slice(NamedTuple):
    """One stretch in which a run was the only one unpaused (``time.time()`` seconds)."""

    on: float
    off: float


def rounds_in_slices(
    ends: Sequence[float | None], walls: Sequence[float], slices: Sequence[Slice]
) -> list[list[int]]:
    """Per slice, the indices of the rounds run wholly inside it.

    A round ends at ``ends[i]`` after ``walls[i]`` seconds; it counts for a slice when it
    started after the slice's resume and ended before its pause (a round that a pause cut
    through, or that a resumed process finished, counts nowhere).
    """
    inside: list[list[int]] = [[] for _ in slices]
    for index, (end, wall) in enumerate(zip(ends, walls, strict=True)):
        if end is None:
            continue
        for number, (on, off) in enumerate(slices):
            if on < end - wall and end < off:
                inside[number].append(index)
                break
    return inside


def cycle_ratios(first: Sequence[Sequence[float]], other: Sequence[Sequence[float]]) -> list[float]:
    """Per cycle (the k-th slice of each run), the median round of ``first``'s slice over
    that of ``other``'s; cycles where either slice counted no round are left out."""
    return [
        statistics.median(mine) / statistics.median(theirs)
        for mine, theirs in zip(first, other, strict=False)
        if mine and theirs
    ]


class _Child:
    """A run of ``command`` (one strategy's) that can be paused and resumed as a whole."""

    def __init__(self, command: list[str], strategy: str, folder: Path) -> None:
        self.strategy = strategy
        self.token = f"{uuid.uuid4().hex}-{strategy}"
        self.out = folder / f"{strategy}.out"
        self.err = folder / f"{strategy}.err"
        self._paused: list[int] = []
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=err,
                env={**os.environ, TOKEN_ENV: self.token},
            )

    def pids(self) -> list[int]:
        """This run's live processes: the child and everything started from it."""
        from fedddl.proc import pids_with_env

        return pids_with_env(TOKEN_ENV, self.token)

    def rounds_done(self) -> int:
        return self.out.read_text().count(_ROUND)

    def finished(self) -> bool:
        return self.process.poll() is not None

    def pause(self) -> float:
        """Stop every process of the run; the time it was done."""
        self._paused = self.pids()
        for pid in self._paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return time.time()

    def resume(self) -> float:
        """Continue what :meth:`pause` stopped; the time it was done."""
        for pid in self._paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._paused = []
        return time.time()

    def wait_for_rounds(self, count: int) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while self.rounds_done() < count:
            if self.finished() or time.monotonic() > deadline:
                raise SystemExit(self.failure(f"did not reach round {count}"))
            time.sleep(0.2)

    def failure(self, what: str) -> str:
        sys.stderr.write(self.err.read_text()[-4000:])
        return f"the {self.strategy} run {what} (exit status {self.process.poll()})"

    def result(self) -> dict[str, Any]:
        lines = [line for line in self.out.read_text().splitlines() if line.startswith(_RESULT)]
        if self.process.returncode != 0 or not lines:
            raise SystemExit(self.failure("failed"))
        found: dict[str, Any] = json.loads(lines[-1][len(_RESULT) :])
        return found


def _run_interleaved(
    argv: list[str] | None, order: list[str], slice_s: float, rounds: int
) -> tuple[dict[str, dict[str, Any]], dict[str, list[list[float]]]]:
    """One repeat with ``--interleave``: each strategy's fresh process started in turn
    (past its first two rounds, which pay Ray's start-up) and paused, then one slice of
    ``slice_s`` seconds each, in ``order``, until one run has done all its rounds; then
    all resumed to finish. Returns each run's result, its ``walls`` and ``exchanges``
    narrowed to the rounds inside its slices, and per strategy the walls of each slice."""
    from fedddl.proc import stop_pids

    slices: dict[str, list[Slice]] = {s: [] for s in order}
    with tempfile.TemporaryDirectory(prefix="bench-round-time-") as folder:
        children: dict[str, _Child] = {}
        try:
            for strategy in order:
                command = _child_command(argv, strategy)
                child = children[strategy] = _Child(command, strategy, Path(folder))
                child.wait_for_rounds(2)
                child.pause()
            while not any(c.finished() or c.rounds_done() >= rounds for c in children.values()):
                for strategy in order:
                    child = children[strategy]
                    on = child.resume()
                    time.sleep(slice_s)
                    slices[strategy].append(Slice(on, child.pause()))
            for child in children.values():
                child.resume()
                child.process.wait(timeout=_START_TIMEOUT_S)
        finally:
            for child in children.values():
                child.resume()
                if not child.finished():  # interrupted: stop the whole run, by pid
                    stop_pids(child.pids())
        results = {s: children[s].result() for s in order}
    by_slice: dict[str, list[list[float]]] = {}
    for strategy, result in results.items():
        inside = rounds_in_slices(result["ends"], result["walls"], slices[strategy])
        by_slice[strategy] = [[result["walls"][i] for i in kept] for kept in inside]
        kept = sorted(i for indices in inside for i in indices)
        if not kept:
            raise SystemExit(f"the {strategy} run had no round inside its slices: "
                             f"raise --rounds or --interleave")
        result["walls"] = [result["walls"][i] for i in kept]
        result["exchanges"] = [result["exchanges"][i] for i in kept]
    return results, by_slice


_RESULT = "BENCH-RESULT "


def _one_run(args: argparse.Namespace, strategy: str) -> int:
    """The child side of :func:`_run_in_fresh_process`: run, print one result line."""
    from fedddl.app_config import AppConfig
    from fedddl.flower.simulation import run

    cfg = AppConfig(
        num_server_rounds=args.rounds,
        strategy=strategy,
        dataset=args.dataset,
        arch=args.arch,
        eval_every=args.eval_every or args.rounds,
        eval_samples=args.eval_samples,
    )
    ends: dict[int, float] = {}

    def progress(line: str) -> None:  # one line per round, at its end (where wall_s is)
        if line.startswith("round "):
            number = int(line[len("round ") :].split("/", 1)[0])
            ends[number] = time.time()
            if args.interleave:
                print(f"{_ROUND}{number}", flush=True)

    result = run(cfg, num_clients=args.num_clients,
                 num_cpus_per_client=args.cpus_per_client, progress=progress)
    rounds = result["rounds"]
    summary = result["summary"]
    out = {
        "walls": [r["wall_s"] for r in rounds[1:]],
        "exchanges": [r["exchange_s"] for r in rounds[1:]],
        "ends": [ends.get(r["round"]) for r in rounds[1:]],
        "final_accuracy": result["final_accuracy"],
        "bytes": summary["mean_bytes_up"] + summary["mean_bytes_down"],
        "curve": [(r["round"], r["accuracy"]) for r in rounds if r["accuracy"] is not None],
    }
    print(_RESULT + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
