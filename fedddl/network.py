"""Latency/bandwidth model of the network between N nodes.

A message of ``B`` bytes from ``src`` to ``dst`` starting at ``t0`` takes
``latency[src][dst]`` seconds plus the time to push ``B`` bytes through
``bandwidth[src][dst] * m(t)`` bytes/s, ``m(t)`` being the product of the optional
piecewise-constant global and sender-uplink traces (``latency + B / bandwidth``
without traces). :class:`LinkScheduler` makes a transfer hold the sender's uplink and
the receiver's downlink (``[start, end)``, or ``[start + latency, end)`` for the
downlink with ``downlink_holds_latency=False``); a transfer waits until both are free.
Files (JSON or TOML) give ``latency_s`` and ``bandwidth_Bps`` as N x N matrices (row
``i`` column ``j`` is the link ``i -> j``) with optional ``trace`` / ``node_traces``,
or ``{"profile": NAME, **kwargs}``; the schema in full: docs/gossip.md.
"""

from __future__ import annotations

import bisect
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads JSON network files only
    tomllib = None

__all__ = [
    "PROFILES",
    "BandwidthTrace",
    "LinkScheduler",
    "NetworkError",
    "NetworkModel",
    "Transfer",
    "load_network",
]

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
PROFILES = ("homogeneous", "heterogeneous")


class NetworkError(ValueError):
    """A network description is invalid."""


@dataclass(frozen=True)
class BandwidthTrace:
    """Piecewise-constant bandwidth multiplier over virtual time."""

    times_s: tuple[float, ...]
    multipliers: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.times_s) == 0 or len(self.times_s) != len(self.multipliers):
            raise NetworkError(
                f"trace needs as many times_s as multipliers (>= 1), got"
                f" {len(self.times_s)} and {len(self.multipliers)}"
            )
        if self.times_s[0] != 0.0:
            raise NetworkError(f"trace times_s must start at 0, got {self.times_s[0]}")
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:], strict=False)):
            raise NetworkError(f"trace times_s must increase strictly, got {list(self.times_s)}")
        if not all(math.isfinite(m) and m > 0 for m in self.multipliers):
            raise NetworkError(f"trace multipliers must be > 0, got {list(self.multipliers)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BandwidthTrace:
        """Build from ``{"times_s": [...], "multipliers": [...]}``."""
        try:
            return cls(
                tuple(float(t) for t in data["times_s"]),
                tuple(float(m) for m in data["multipliers"]),
            )
        except (KeyError, TypeError) as exc:
            raise NetworkError(f"trace needs lists 'times_s' and 'multipliers': {exc}") from exc

    def to_dict(self) -> dict[str, list[float]]:
        """Inverse of :meth:`from_dict`."""
        return {"times_s": list(self.times_s), "multipliers": list(self.multipliers)}

    def multiplier(self, time_s: float) -> float:
        """Multiplier in force at ``time_s`` (the first one before 0)."""
        k = max(bisect.bisect_right(self.times_s, time_s) - 1, 0)
        return self.multipliers[k]

    def times_product(self, other: BandwidthTrace | None) -> BandwidthTrace:
        """Trace of the product of both multipliers."""
        if other is None:
            return self
        times = sorted(set(self.times_s) | set(other.times_s))
        return BandwidthTrace(
            tuple(times), tuple(self.multiplier(t) * other.multiplier(t) for t in times)
        )

    def serialization_time(self, start_s: float, num_bytes: float, bandwidth_Bps: float) -> float:
        """Seconds to push ``num_bytes`` at ``bandwidth_Bps * multiplier(t)`` from ``start_s``."""
        remaining, t = float(num_bytes), float(start_s)
        k = max(bisect.bisect_right(self.times_s, t) - 1, 0)
        while True:
            rate = bandwidth_Bps * self.multipliers[k]
            end = self.times_s[k + 1] if k + 1 < len(self.times_s) else math.inf
            if remaining <= rate * (end - t):
                return t + remaining / rate - start_s
            remaining -= rate * (end - t)
            t, k = end, k + 1


class NetworkModel:
    """Per-link latency and bandwidth for ``N`` nodes (see the module docstring).

    Parameters
    ----------
    latency_s
        ``N x N`` seconds, ``>= 0``; entry ``[i][j]`` is the link ``i -> j``.
    bandwidth_Bps
        ``N x N`` bytes per second, ``> 0`` off the diagonal.
    trace
        Optional bandwidth multiplier over time for every link.
    node_traces
        Optional multiplier over time for the uplink of single nodes.
    name
        Label used in reports.
    """

    def __init__(
        self,
        latency_s: Sequence[Sequence[float]] | np.ndarray,
        bandwidth_Bps: Sequence[Sequence[float]] | np.ndarray,
        *,
        trace: BandwidthTrace | None = None,
        node_traces: Mapping[int, BandwidthTrace] | None = None,
        name: str = "custom",
    ) -> None:
        self.latency_s = _square_matrix(latency_s, "latency_s")
        self.bandwidth_Bps = _square_matrix(bandwidth_Bps, "bandwidth_Bps")
        n = self.latency_s.shape[0]
        if self.bandwidth_Bps.shape != self.latency_s.shape:
            raise NetworkError(
                f"latency_s is {n}x{n} but bandwidth_Bps is"
                f" {self.bandwidth_Bps.shape[0]}x{self.bandwidth_Bps.shape[1]}"
            )
        off = ~np.eye(n, dtype=bool)
        if (self.latency_s < 0).any():
            i, j = np.argwhere(self.latency_s < 0)[0]
            raise NetworkError(f"latency_s[{i}][{j}] = {self.latency_s[i, j]} is negative")
        if (self.bandwidth_Bps[off] <= 0).any():
            i, j = np.argwhere((self.bandwidth_Bps <= 0) & off)[0]
            raise NetworkError(
                f"bandwidth_Bps[{i}][{j}] = {self.bandwidth_Bps[i, j]} must be > 0"
            )
        node_traces = dict(node_traces or {})
        for node in node_traces:
            if not 0 <= node < n:
                raise NetworkError(f"node_traces names node {node}, network has nodes 0..{n - 1}")
        self.trace = trace
        self.node_traces = node_traces
        self.name = name
        # Effective uplink trace per node, or None where the rate is constant.
        self._uplink_traces: list[BandwidthTrace | None] = []
        for node in range(n):
            own = node_traces.get(node)
            if trace is None:
                self._uplink_traces.append(own)
            else:
                self._uplink_traces.append(trace.times_product(own))

    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N``."""
        return int(self.latency_s.shape[0])

    # ------------------------------------------------------------ profiles
    @classmethod
    def homogeneous(
        cls, num_nodes: int, latency_s: float = 0.05, bandwidth_Bps: float = 100 * MBIT
    ) -> NetworkModel:
        """All links equal (default 50 ms, 100 Mbit/s)."""
        _check_num_nodes(num_nodes)
        return cls(
            np.full((num_nodes, num_nodes), float(latency_s)),
            np.full((num_nodes, num_nodes), float(bandwidth_Bps)),
            name="homogeneous",
        )

    @classmethod
    def heterogeneous(
        cls,
        num_nodes: int,
        *,
        num_regions: int = 4,
        intra_latency_s: float = 0.01,
        intra_bandwidth_Bps: float = 1000 * MBIT,
        inter_latency_s: float = 0.15,
        inter_bandwidth_Bps: float = 20 * MBIT,
        slow_uplink_fraction: float = 0.25,
        slow_uplink_Bps: float = 10 * MBIT,
        seed: int = 0,
    ) -> NetworkModel:
        """Wide-area network of regions.

        Node ``i`` lies in region ``i * num_regions // num_nodes`` (contiguous
        blocks).  Links inside a region are fast (default 10 ms, 1 Gbit/s),
        across regions slow (150 ms, 20 Mbit/s).  A seeded random
        ``slow_uplink_fraction`` of the nodes has its uplink capped at
        ``slow_uplink_Bps`` on every outgoing link.
        """
        _check_num_nodes(num_nodes)
        if not 1 <= num_regions <= num_nodes:
            raise NetworkError(f"num_regions must be in 1..{num_nodes}, got {num_regions}")
        if not 0.0 <= slow_uplink_fraction <= 1.0:
            raise NetworkError(
                f"slow_uplink_fraction must be in [0, 1], got {slow_uplink_fraction}"
            )
        region = np.arange(num_nodes) * num_regions // num_nodes
        same = region[:, None] == region[None, :]
        latency = np.where(same, intra_latency_s, inter_latency_s).astype(float)
        bandwidth = np.where(same, intra_bandwidth_Bps, inter_bandwidth_Bps).astype(float)
        num_slow = round(slow_uplink_fraction * num_nodes)
        slow = np.random.default_rng(seed).choice(num_nodes, size=num_slow, replace=False)
        bandwidth[slow, :] = np.minimum(bandwidth[slow, :], slow_uplink_Bps)
        return cls(latency, bandwidth, name="heterogeneous")

    # ------------------------------------------------------------ files
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NetworkModel:
        """Build from the parsed mapping of a network file (schema: docs/gossip.md)."""
        if not isinstance(data, Mapping):
            raise NetworkError(f"network description must be a mapping, got {type(data).__name__}")
        if "profile" in data:
            params = {k: v for k, v in data.items() if k != "profile"}
            profile = data["profile"]
            if profile not in PROFILES:
                raise NetworkError(f"unknown profile {profile!r}; choose one of {PROFILES}")
            try:
                model: NetworkModel = getattr(cls, profile)(**params)
            except TypeError as exc:
                raise NetworkError(f"bad parameters for profile {profile!r}: {exc}") from exc
            return model
        unknown = set(data) - {"name", "latency_s", "bandwidth_Bps", "trace", "node_traces"}
        if unknown:
            raise NetworkError(f"unknown keys in network description: {sorted(unknown)}")
        for key in ("latency_s", "bandwidth_Bps"):
            if key not in data:
                raise NetworkError(f"network description lacks {key!r}")
        trace = BandwidthTrace.from_dict(data["trace"]) if "trace" in data else None
        node_traces = {}
        for node, spec in dict(data.get("node_traces", {})).items():
            try:
                node_id = int(node)
            except ValueError:
                raise NetworkError(f"node_traces key {node!r} is not a node index") from None
            node_traces[node_id] = BandwidthTrace.from_dict(spec)
        return cls(
            data["latency_s"],
            data["bandwidth_Bps"],
            trace=trace,
            node_traces=node_traces,
            name=str(data.get("name", "custom")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> NetworkModel:
        """Load a ``.json`` or ``.toml`` network description."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise NetworkError(f"cannot read network file {path}: {exc}") from exc
        try:
            if path.suffix == ".toml":
                if tomllib is None:
                    raise NetworkError(f"{path}: TOML network files need Python >= 3.11")
                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            if isinstance(exc, NetworkError):
                raise
            kind = path.suffix[1:] or "json"
            raise NetworkError(f"network file {path} is not valid {kind}: {exc}") from exc
        try:
            model = cls.from_dict(data)
        except NetworkError as exc:
            raise NetworkError(f"{path}: {exc}") from exc
        if model.name == "custom":
            model.name = path.stem
        return model

    def to_dict(self) -> dict[str, Any]:
        """Explicit-matrix description (inverse of :meth:`from_dict`)."""
        data: dict[str, Any] = {
            "name": self.name,
            "latency_s": self.latency_s.tolist(),
            "bandwidth_Bps": self.bandwidth_Bps.tolist(),
        }
        if self.trace is not None:
            data["trace"] = self.trace.to_dict()
        if self.node_traces:
            data["node_traces"] = {str(k): v.to_dict() for k, v in self.node_traces.items()}
        return data

    # ------------------------------------------------------------ timing
    def transfer_time(self, src: int, dst: int, num_bytes: int, start_time: float = 0.0) -> float:
        """Seconds for ``num_bytes`` from ``src`` to ``dst`` starting at ``start_time``."""
        self._check_link(src, dst)
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        bandwidth = float(self.bandwidth_Bps[src, dst])
        trace = self._uplink_traces[src]
        if trace is None:
            serial = num_bytes / bandwidth
        else:
            serial = trace.serialization_time(start_time, num_bytes, bandwidth)
        return float(self.latency_s[src, dst]) + serial

    def _check_link(self, src: int, dst: int) -> None:
        n = self.num_nodes
        if not (0 <= src < n and 0 <= dst < n):
            raise ValueError(f"link {src} -> {dst} outside nodes 0..{n - 1}")
        if src == dst:
            raise ValueError(f"no link from node {src} to itself")


@dataclass(frozen=True)
class Transfer:
    """A reserved transfer: it starts at ``start_s`` and is delivered at ``end_s``."""

    src: int
    dst: int
    num_bytes: int
    requested_s: float
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        """Time on the wire (queueing excluded)."""
        return self.end_s - self.start_s


class LinkScheduler:
    """Busy-until tracker of every node's uplink and downlink (module docstring).

    Parameters
    ----------
    network
        The network whose transfer times are used.
    downlink_contention
        Whether a receiver's downlink is a busy resource too.
    downlink_holds_latency
        Whether the downlink is busy for the whole transfer (default) or only
        once the first byte arrives (``start + latency``); see the module docstring.
    """

    def __init__(
        self,
        network: NetworkModel,
        *,
        downlink_contention: bool = True,
        downlink_holds_latency: bool = True,
    ) -> None:
        self.network = network
        self.downlink_contention = downlink_contention
        self.downlink_holds_latency = downlink_holds_latency
        self._up_free = [0.0] * network.num_nodes
        self._down_free = [0.0] * network.num_nodes

    def uplink_free_at(self, node: int) -> float:
        """Virtual time at which ``node``'s uplink becomes free."""
        return self._up_free[node]

    def downlink_free_at(self, node: int) -> float:
        """Virtual time at which ``node``'s downlink becomes free."""
        return self._down_free[node]

    def uplink_busy(self, node: int, time_s: float) -> bool:
        """Whether ``node`` is sending at ``time_s``."""
        return self._up_free[node] > time_s

    def downlink_busy(self, node: int, time_s: float) -> bool:
        """Whether ``node`` is receiving at ``time_s``."""
        return self._down_free[node] > time_s

    def reserve(self, src: int, dst: int, num_bytes: int, ready_s: float) -> Transfer:
        """Book a transfer that is ready at ``ready_s``; it starts when its links are free."""
        start = max(ready_s, self._up_free[src])
        if self.downlink_contention:
            # The downlink must be free when the first byte arrives.
            lead = 0.0 if self.downlink_holds_latency else float(self.network.latency_s[src, dst])
            start = max(start, self._down_free[dst] - lead)
        end = start + self.network.transfer_time(src, dst, num_bytes, start)
        self._up_free[src] = end
        if self.downlink_contention:
            self._down_free[dst] = max(self._down_free[dst], end)
        return Transfer(src, dst, num_bytes, ready_s, start, end)


def load_network(spec: str | Path, num_nodes: int, *, seed: int = 0) -> NetworkModel:
    """Network by profile name (``homogeneous``, ``heterogeneous``) or file path.

    Raises
    ------
    NetworkError
        If the file is invalid or does not have ``num_nodes`` nodes.
    """
    if str(spec) == "homogeneous":
        return NetworkModel.homogeneous(num_nodes)
    if str(spec) == "heterogeneous":
        return NetworkModel.heterogeneous(num_nodes, seed=seed)
    path = Path(spec)
    if not path.exists():
        raise NetworkError(f"network {str(spec)!r} is neither a profile {PROFILES} nor a file")
    model = NetworkModel.from_file(path)
    if model.num_nodes != num_nodes:
        raise NetworkError(
            f"{path} describes {model.num_nodes} nodes, but {num_nodes} were asked for"
        )
    return model


def _square_matrix(values: Sequence[Sequence[float]] | np.ndarray, what: str) -> np.ndarray:
    try:
        matrix = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise NetworkError(f"{what} must be a square matrix of numbers: {exc}") from exc
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise NetworkError(f"{what} must be a non-empty square matrix, got shape {matrix.shape}")
    if not np.isfinite(matrix).all():
        raise NetworkError(f"{what} contains a non-finite value")
    return matrix


def _check_num_nodes(num_nodes: int) -> None:
    if num_nodes < 2:
        raise NetworkError(f"a network needs at least 2 nodes, got {num_nodes}")
