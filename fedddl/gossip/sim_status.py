"""Delayed views of the nodes' shared states in the simulator.

Every broadcast of a :class:`~fedddl.gossip.scheduler.PeerState` is recorded
with its time; node ``i`` sees node ``j``'s most recent state published at least
``latency[j][i]`` seconds ago (status messages are tens of bytes, so their
serialisation time is neglected and they do not occupy links).  The initial
state is known to all at time 0.  Each broadcast costs ``N - 1`` messages of
``len(state.to_bytes())`` bytes, which :meth:`StatusBoard.publish` returns.
"""

from __future__ import annotations

import bisect

from fedddl.gossip.scheduler import PeerState
from fedddl.network import NetworkModel

__all__ = ["StatusBoard"]


class StatusBoard:
    """History of published states and delayed per-observer views."""

    def __init__(self, network: NetworkModel) -> None:
        self.network = network
        n = network.num_nodes
        self._times: list[list[float]] = [[] for _ in range(n)]
        self._states: list[list[PeerState]] = [[] for _ in range(n)]
        self.messages = 0
        self.bytes = 0

    def publish(self, state: PeerState, time_s: float) -> int:
        """Broadcast ``state`` at ``time_s`` to all other nodes; returns the bytes sent."""
        times = self._times[state.node_id]
        if times and time_s < times[-1]:
            raise ValueError(f"status of node {state.node_id} published out of time order")
        times.append(time_s)
        self._states[state.node_id].append(state)
        peers = self.network.num_nodes - 1
        sent = peers * len(state.to_bytes())
        self.messages += peers
        self.bytes += sent
        return sent

    def view(self, observer: int, time_s: float) -> dict[int, PeerState]:
        """What ``observer`` knows at ``time_s`` of every other node that has published."""
        seen: dict[int, PeerState] = {}
        for node, times in enumerate(self._times):
            if node == observer or not times:
                continue
            delay = float(self.network.latency_s[node, observer])
            k = bisect.bisect_right(times, time_s - delay) - 1
            seen[node] = self._states[node][max(k, 0)]
        return seen
