"""Seed aggregation, time-to-target and the simulated link-time model used by the report.

Everything here is pure numpy on the JSON written by ``fedddl simulate`` and
``fedddl gossip``; nothing is estimated that a run did not record.

Link-time model (ternary experiment)
------------------------------------
A synchronous round of server-based training is simulated on one *server
link* of bandwidth ``B`` (bytes/s) and one-way latency ``L`` (s) that all ``N``
clients share::

    t_round = t_compute + (L + bytes_up / B) + (L + bytes_down / B)

``bytes_up`` / ``bytes_down`` are the round's totals over all clients as
recorded by the simulation, so the server link carries every client's upload
and every client's download in turn (it is the bottleneck: ``N`` clients on
one link see ``B / N`` each). Upload and download are sequential because the
server needs every update before it can aggregate. ``t_compute`` is the
median of the run's per-round ``wall_s`` (robust to stalls and to Ray's actor
start-up in round 1); it includes the simulation's own overheads, so the
communication term is what differs between strategies.
Each transfer term is :class:`fedddl.network.NetworkModel`'s transfer time
(``latency + bytes / bandwidth``) on a homogeneous two-node network.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Band",
    "Link",
    "aggregate_rounds",
    "band_on_grid",
    "first_reach",
    "mean_std",
    "round_series",
    "simulated_round_times",
    "transfer_time",
]


@dataclass(frozen=True)
class Link:
    """A server link for the simulated wall-time model.

    Attributes
    ----------
    name : str
        Label used in plots and tables, e.g. ``"100 Mbit/s"``.
    bandwidth_Bps : float
        Bandwidth in bytes per second.
    latency_s : float
        One-way latency in seconds.
    """

    name: str
    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"link {self.name!r}: bandwidth_Bps must be > 0")
        if self.latency_s < 0:
            raise ValueError(f"link {self.name!r}: latency_s must be >= 0")


@dataclass(frozen=True)
class Band:
    """Mean and spread of one curve over seeds, on a shared x grid.

    Attributes
    ----------
    x : numpy.ndarray
        Shared x values.
    mean, std, low, high : numpy.ndarray
        Mean, standard deviation, minimum and maximum over seeds at each x.
    num_seeds : int
        Number of seeds aggregated.
    """

    x: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    low: np.ndarray
    high: np.ndarray
    num_seeds: int


def transfer_time(num_bytes: float, link: Link) -> float:
    """Seconds to move ``num_bytes`` over ``link``: ``latency + bytes / bandwidth``.

    Computed by :class:`fedddl.network.NetworkModel` (a homogeneous two-node
    network with the link's parameters), so the report and the gossip
    simulator share one network model.
    """
    from fedddl.network import NetworkModel

    model = NetworkModel.homogeneous(2, link.latency_s, link.bandwidth_Bps)
    return model.transfer_time(0, 1, round(num_bytes))


def round_series(result: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Per-round arrays from a ``fedddl simulate`` result, in round order.

    When the result has ``initial`` (the model before training), it becomes
    round 0 with no bytes and no time, so curves start at the initial accuracy.
    The first trained round's ``wall_s`` includes starting the Ray actors
    (seconds to minutes, nothing to do with training), so it is replaced by the
    median ``wall_s`` of the later rounds; ``wall_s_raw`` keeps what was measured.

    Returns
    -------
    dict
        ``round``, ``accuracy``, ``loss``, ``bytes_up``, ``bytes_down``, ``wall_s``,
        ``wall_s_raw`` (float arrays), ``cum_bytes`` (cumulative up + down) and
        ``cum_wall_s``.

    Raises
    ------
    ValueError
        If the result has no rounds or no evaluated round, or a round misses a field.

    Notes
    -----
    Only evaluated rounds are kept (``eval-every`` > 1 leaves the others with a null
    accuracy); ``bytes_*`` and ``wall_s`` stay per round, while ``cum_bytes`` and
    ``cum_wall_s`` count every round up to the kept one. A null ``loss`` (a diverged
    model) becomes NaN.
    """
    rounds = sorted(result.get("rounds", []), key=lambda r: int(r["round"]))
    if not rounds:
        raise ValueError("simulate result has no rounds")
    keys = ("round", "accuracy", "loss", "bytes_up", "bytes_down", "wall_s")
    rows: list[list[float]] = []
    initial = result.get("initial")
    if isinstance(initial, Mapping) and "accuracy" in initial:
        rows.append([0.0, float(initial["accuracy"]), float(initial.get("loss", np.nan)),
                     0.0, 0.0, 0.0])
    for r in rounds:
        missing = [key for key in keys if key not in r]
        if missing:
            raise ValueError(f"simulate result round lacks field {missing[0]!r}")
        # A round without evaluation (eval-every > 1) has a null accuracy and loss; a
        # diverged model's loss is not finite, which the results JSON stores as null too.
        rows.append([np.nan if r[key] is None and key in ("accuracy", "loss") else float(r[key])
                     for key in keys])
    table = np.array(rows, dtype=np.float64)
    out = {key: table[:, i].copy() for i, key in enumerate(keys)}
    out["wall_s_raw"] = out["wall_s"].copy()
    trained = np.flatnonzero(out["round"] > 0)
    if trained.size >= 2:
        out["wall_s"][trained[0]] = float(np.median(out["wall_s"][trained[1:]]))
    out["cum_bytes"] = np.cumsum(out["bytes_up"] + out["bytes_down"])
    out["cum_wall_s"] = np.cumsum(out["wall_s"])
    evaluated = ~np.isnan(out["accuracy"])
    if not evaluated.any():
        raise ValueError("simulate result has no evaluated round")
    # Curves are drawn at the evaluated rounds; bytes and time count every round.
    return {key: values[evaluated] for key, values in out.items()}


def simulated_round_times(series: Mapping[str, np.ndarray], link: Link) -> np.ndarray:
    """Cumulative simulated wall time per round on ``link`` (see the module docstring).

    The compute term of every trained round is the run's *median* ``wall_s``:
    on a shared machine single rounds stall when other jobs run, and the median
    keeps those stalls (which have nothing to do with the strategy) out of the
    comparison. A round that moved no bytes and did no training (the initial
    evaluation, round 0) costs nothing. When only every N-th round was evaluated (and
    kept by :func:`round_series`), each kept round counts for the N rounds up to it.
    """
    trained = series["round"] > 0
    compute = float(np.median(series["wall_s"][trained])) if np.any(trained) else 0.0
    times = []
    for is_trained, up, down in zip(trained, series["bytes_up"], series["bytes_down"],
                                    strict=True):
        total = compute if is_trained else 0.0
        if up > 0:
            total += transfer_time(up, link)
        if down > 0:
            total += transfer_time(down, link)
        times.append(total)
    # Evaluated every N rounds: each kept round stands for the N rounds up to it.
    gaps = np.diff(series["round"], prepend=0.0)
    return np.cumsum(np.array(times, dtype=np.float64) * gaps)


def first_reach(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray,
                target: float) -> float | None:
    """The first ``x`` at which ``y >= target``, or None if never reached."""
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    hits = np.flatnonzero(ys >= target)
    return float(xs[hits[0]]) if hits.size else None


def mean_std(values: Iterable[float | None]) -> tuple[float, float, int, int]:
    """Mean and std (population) of the non-None values, their count and the total count.

    Returns ``(nan, nan, 0, n)`` when no value is present.
    """
    items = list(values)
    present = np.array([v for v in items if v is not None], dtype=np.float64)
    if present.size == 0:
        return float("nan"), float("nan"), 0, len(items)
    return float(present.mean()), float(present.std()), int(present.size), len(items)


def _band(x: np.ndarray, stack: np.ndarray) -> Band:
    return Band(
        x=x,
        mean=stack.mean(axis=0),
        std=stack.std(axis=0),
        low=stack.min(axis=0),
        high=stack.max(axis=0),
        num_seeds=int(stack.shape[0]),
    )


def aggregate_rounds(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> Band:
    """Aggregate per-round curves of several seeds, aligned by round index.

    Runs are truncated to the shortest; the x of each round is the mean over
    seeds (rounds are the unit of alignment, so for bytes or simulated time the
    x spread between seeds is small and not drawn).

    Raises
    ------
    ValueError
        If no curve is given or the lengths of an x and its y differ.
    """
    if not xs or len(xs) != len(ys):
        raise ValueError("aggregate_rounds needs one x array per y array, at least one")
    for x, y in zip(xs, ys, strict=True):
        if len(x) != len(y):
            raise ValueError("an x array and its y array differ in length")
    n = min(len(y) for y in ys)
    x_stack = np.stack([np.asarray(x[:n], dtype=np.float64) for x in xs])
    y_stack = np.stack([np.asarray(y[:n], dtype=np.float64) for y in ys])
    return _band(x_stack.mean(axis=0), y_stack)


def band_on_grid(curves: Sequence[Sequence[Sequence[float]]], num_points: int = 200) -> Band:
    """Aggregate ``[[x, y], ...]`` curves with different x onto one grid.

    Each curve is read as a step function (a value holds until the next point),
    which is what a gossip accuracy probe means. The grid spans from the latest
    first point to the earliest last point over seeds, so no curve is extrapolated.

    Raises
    ------
    ValueError
        If no curve is given or a curve is empty.
    """
    if not curves:
        raise ValueError("band_on_grid needs at least one curve")
    arrays = []
    for curve in curves:
        arr = np.asarray(curve, dtype=np.float64)
        if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] != 2:
            raise ValueError("each curve must be a non-empty list of [x, y] pairs")
        arrays.append(arr[np.argsort(arr[:, 0], kind="stable")])
    start = max(float(a[0, 0]) for a in arrays)
    stop = min(float(a[-1, 0]) for a in arrays)
    grid = np.linspace(start, stop, num_points) if stop > start else np.array([start])
    stack = []
    for arr in arrays:
        idx = np.searchsorted(arr[:, 0], grid, side="right") - 1
        stack.append(arr[np.clip(idx, 0, arr.shape[0] - 1), 1])
    return _band(grid, np.stack(stack))
