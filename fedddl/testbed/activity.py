"""What the testbed's links and CPUs did over time: a sampler, and each round's phases.

:class:`ActivitySampler` reads, every ``interval_s``, the hub namespace's port counters
(``p<i>``: *tx* is what node ``i`` received through its downlink, *rx* what it sent
through its uplink, whole frames) and the machine's busy CPU time (``/proc/stat``).
:func:`round_activity` cuts one round out of the samples: per node the span of its
download and of its upload (the first to the last interval that moved more than
``active`` of the node's peak rate in that round) and the busy time in them, and the
CPUs' mean use over the round and while a transfer ran. docs/testbed.md uses these
to see whether a transfer delayed the round or hid behind compute.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedddl.testbed.netns import enter_netns

__all__ = ["ActivitySampler", "round_activity", "rounds_activity"]


def _port_bytes(ports: Sequence[str]) -> list[tuple[int, int]]:
    """``(rx, tx)`` bytes of each of ``ports`` in this thread's network namespace."""
    table: dict[str, tuple[int, int]] = {}
    for line in Path("/proc/thread-self/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        values = fields.split()
        table[name.strip()] = (int(values[0]), int(values[8]))
    missing = [p for p in ports if p not in table]
    if missing:
        raise RuntimeError(f"no counters for {missing} in this namespace")
    return [table[p] for p in ports]


def _busy_cpu_s() -> float:
    """Seconds of CPU time the whole machine spent outside idle and iowait so far."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


class ActivitySampler:
    """Sample the hub's port counters and the busy CPU time in a background thread.

    Parameters
    ----------
    hub : str
        The hub namespace (``Testbed.hub``).
    ports : sequence of str
        Its ports to read, node ``i``'s being ``p<i>``.
    interval_s : float
        Seconds between samples (> 0).

    ``samples`` holds ``[unix_time, busy_cpu_s, rx_0, tx_0, rx_1, tx_1, ...]`` rows;
    :meth:`stop` ends the thread (idempotent). A failure of the thread ends the sampling
    early and is kept in ``error`` (the samples taken stay), so it never ends a run.
    """

    def __init__(self, hub: str, ports: Sequence[str], interval_s: float = 0.2) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.hub, self.ports, self.interval_s = hub, list(ports), float(interval_s)
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="testbed-activity", daemon=True)

    def start(self) -> ActivitySampler:
        """Start sampling; returns ``self``."""
        self._thread.start()
        return self

    def stop(self) -> list[list[float]]:
        """Stop sampling and return the samples taken."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.samples

    def _loop(self) -> None:
        try:
            enter_netns(self.hub)
            next_at = time.monotonic()
            while not self._stop.is_set():
                row: list[float] = [time.time(), _busy_cpu_s()]
                for rx, tx in _port_bytes(self.ports):
                    row += [rx, tx]
                self.samples.append(row)
                next_at += self.interval_s
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        except Exception as exc:  # kept for the caller; the run goes on
            self.error = exc


def _hot(rates: Sequence[float], active: float) -> list[bool]:
    """Which intervals moved at least ``active`` x the peak rate (none if nothing moved)."""
    peak = max(rates, default=0.0)
    return [peak > 0 and r >= active * peak for r in rates]


def _span(times: Sequence[float], rates: Sequence[float], hot: Sequence[bool]) -> dict[str, float]:
    """First start, last end and busy seconds of the ``hot`` intervals; all their bytes."""
    marked = [i for i, h in enumerate(hot) if h]
    if not marked:
        return {"start_s": 0.0, "end_s": 0.0, "busy_s": 0.0, "bytes": 0.0}
    busy = sum(times[i + 1] - times[i] for i in marked)
    return {"start_s": times[marked[0]], "end_s": times[marked[-1] + 1], "busy_s": busy,
            "bytes": sum(rates[i] * (times[i + 1] - times[i]) for i in range(len(rates)))}


def round_activity(
    samples: Sequence[Sequence[float]], start: float, end: float, *, active: float = 0.1,
    clients: int | None = None,
) -> dict[str, Any]:
    """What each node's links and the CPUs did between Unix times ``start`` and ``end``.

    Returns ``download`` / ``upload`` (one ``{start_s, end_s, busy_s, bytes}`` per node,
    times from ``start``; ``bytes`` counts whole frames), ``transfer_span_s`` (first start
    to last end per direction over the first ``clients`` nodes, default all), ``cpu_use``
    (mean busy CPUs over the round) and ``cpu_use_transfer`` (the same over the intervals
    in which one of those nodes was above ``active`` of its peak in either direction; None
    if none was).
    """
    if not end > start:
        raise ValueError(f"round end {end} is not after its start {start}")
    rows = [r for r in samples if start <= r[0] <= end]
    if len(rows) < 3:
        raise ValueError(f"{len(rows)} samples in a {end - start:.2f} s round: sample faster")
    times = [r[0] - start for r in rows]
    dt = [b - a for a, b in itertools.pairwise(times)]
    cpu = [(rows[i + 1][1] - rows[i][1]) / dt[i] for i in range(len(dt))]
    nodes = (len(rows[0]) - 2) // 2
    counted = nodes if clients is None else clients
    result: dict[str, Any] = {"download": [], "upload": [], "transfer_span_s": {}}
    moving = [False] * len(dt)
    for key, column in (("upload", 0), ("download", 1)):
        for node in range(nodes):
            col = 2 + 2 * node + column
            rates = [(rows[i + 1][col] - rows[i][col]) / dt[i] for i in range(len(dt))]
            hot = _hot(rates, active)
            result[key].append(_span(times, rates, hot))
            if node < counted:
                moving = [m or h for m, h in zip(moving, hot, strict=True)]
        spans = [s for s in result[key][:counted] if s["busy_s"] > 0]
        result["transfer_span_s"][key] = (max(s["end_s"] for s in spans)
                                          - min(s["start_s"] for s in spans)) if spans else 0.0
    total = sum(dt)
    result["cpu_use"] = sum(c * d for c, d in zip(cpu, dt, strict=True)) / total
    during = sum(d for d, m in zip(dt, moving, strict=True) if m)
    result["cpu_use_transfer"] = (sum(c * d for c, d, m in zip(cpu, dt, moving, strict=True) if m)
                                  / during) if during else None
    return result


def rounds_activity(result: Mapping[str, Any], samples: Sequence[Sequence[float]],
                    **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`round_activity` of every round of a results JSON that has ``started_at``."""
    out = []
    for record in result["rounds"]:
        if record.get("started_at") is None:
            continue
        start = float(record["started_at"])
        out.append({"round": int(record["round"]),
                    **round_activity(samples, start, start + float(record["wall_s"]), **kwargs)})
    return out
