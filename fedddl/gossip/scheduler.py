"""Partner selection for gossip SGD: classic random gossip and communication scheduling.

:class:`PeerState` is what every node shares about itself (``enabled``: its downlink is
free; ``model_version``: a Lamport clock over SGD steps; ``est_comm_time_s``: its
estimated seconds to send one model message to each peer; ``steps_per_s``, ``0`` =
unknown), serialised in ``21 + 8 * len(est_comm_time_s)`` bytes.
:class:`CommunicationScheduler` picks an enabled other node whose model would not
arrive stale, with probability proportional to ``1 / estimated time`` (or the fastest,
``selection="fastest"``), and returns ``None`` to defer when none is left;
:class:`RandomScheduler` picks a uniformly random other node. The rules step by step:
docs/gossip.md.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedddl.gossip.estimator import CommTimeEstimator

__all__ = [
    "SCHEDULERS",
    "SELECTIONS",
    "CommunicationScheduler",
    "PeerState",
    "RandomScheduler",
    "Scheduler",
    "get_scheduler",
]

SELECTIONS = ("fastest", "proportional")
_HEADER = struct.Struct("<i?qfi")  # node_id, enabled, model_version, steps_per_s, count
_ENTRY = struct.Struct("<if")  # peer, est_comm_time_s


@dataclass(frozen=True)
class PeerState:
    """What a node shares about itself (the fields: docs/gossip.md)."""

    node_id: int
    enabled: bool
    model_version: int
    est_comm_time_s: Mapping[int, float] = field(default_factory=dict)
    steps_per_s: float = 0.0

    def to_bytes(self) -> bytes:
        """Serialise to the status-message layout (little endian, fixed size per peer)."""
        parts = [
            _HEADER.pack(
                self.node_id,
                self.enabled,
                self.model_version,
                self.steps_per_s,
                len(self.est_comm_time_s),
            )
        ]
        parts += [_ENTRY.pack(p, t) for p, t in sorted(self.est_comm_time_s.items())]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerState:
        """Parse :meth:`to_bytes` output; raises ``ValueError`` on a malformed message."""
        if len(data) < _HEADER.size:
            raise ValueError(f"status message too short: {len(data)} < {_HEADER.size} bytes")
        node_id, enabled, version, speed, count = _HEADER.unpack_from(data)
        expected = _HEADER.size + count * _ENTRY.size
        if count < 0 or len(data) != expected:
            raise ValueError(
                f"status message has {len(data)} bytes, header announces {count} peers"
                f" ({expected} bytes)"
            )
        est = dict(
            _ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size) for i in range(count)
        )
        return cls(node_id, bool(enabled), version, est, speed)

    @staticmethod
    def message_size(num_peers: int) -> int:
        """Bytes of a status message carrying estimates for ``num_peers`` peers."""
        return _HEADER.size + num_peers * _ENTRY.size


class Scheduler(ABC):
    """Chooses the gossip partner of node ``me``."""

    name: str = ""

    @abstractmethod
    def choose_peer(
        self,
        me: int,
        peers: Mapping[int, PeerState],
        model_bytes: int,
        estimator: CommTimeEstimator,
        rng: np.random.Generator,
    ) -> int | None:
        """Return the peer ``me`` sends its current model to (never ``me``), or ``None`` to defer.

        ``peers`` holds the last known state of each node (``peers[me]`` gives ``me``'s model
        version); ``model_bytes`` sizes the message for ``estimator``; ``rng`` is seeded by the
        caller, so a choice is reproducible.
        """


class RandomScheduler(Scheduler):
    """Classic gossip: a uniformly random other node, whatever its state."""

    name = "random"

    def choose_peer(
        self,
        me: int,
        peers: Mapping[int, PeerState],
        model_bytes: int,
        estimator: CommTimeEstimator,
        rng: np.random.Generator,
    ) -> int | None:
        others = sorted(p for p in peers if p != me)
        if not others:
            return None
        return others[int(rng.integers(len(others)))]


class CommunicationScheduler(Scheduler):
    """The communication-scheduling method (Shudo et al.); the rules: docs/gossip.md.

    Parameters
    ----------
    stale_threshold_steps
        Skip a peer whose predicted clock at arrival exceeds our model's clock
        by more than this many steps.
    tie_tolerance
        Peers whose estimate is within ``(1 + tie_tolerance)`` of the fastest
        are treated as equally fast.
    selection
        ``"fastest"`` or ``"proportional"`` (step 4 of the rules in docs/gossip.md).
    """

    name = "scheduled"

    def __init__(
        self,
        stale_threshold_steps: float = 10.0,
        tie_tolerance: float = 0.1,
        selection: str = "proportional",
    ) -> None:
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        self.selection = selection
        if not stale_threshold_steps >= 0.0:
            raise ValueError(f"stale_threshold_steps must be >= 0, got {stale_threshold_steps}")
        if not tie_tolerance >= 0.0:
            raise ValueError(f"tie_tolerance must be >= 0, got {tie_tolerance}")
        self.stale_threshold_steps = float(stale_threshold_steps)
        self.tie_tolerance = float(tie_tolerance)

    def estimated_time(
        self, me: int, peer: PeerState, model_bytes: int, estimator: CommTimeEstimator
    ) -> float:
        """Transfer time to ``peer`` as the scheduler sees it (step 2 of the docstring)."""
        if not estimator.observed(peer.node_id) and me in peer.est_comm_time_s:
            return float(peer.est_comm_time_s[me])
        return estimator.estimate(peer.node_id, model_bytes)

    def choose_peer(
        self,
        me: int,
        peers: Mapping[int, PeerState],
        model_bytes: int,
        estimator: CommTimeEstimator,
        rng: np.random.Generator,
    ) -> int | None:
        own = peers.get(me)
        candidates: list[tuple[float, int]] = []
        for node_id in sorted(peers):
            state = peers[node_id]
            if node_id == me or not state.enabled:
                continue
            est = self.estimated_time(me, state, model_bytes, estimator)
            if own is not None:
                lag = state.model_version + state.steps_per_s * est - own.model_version
                if lag > self.stale_threshold_steps:
                    continue
            candidates.append((est, node_id))
        if not candidates:
            return None
        if self.selection == "proportional":
            rates = np.array([1.0 / max(est, 1e-9) for est, _ in candidates])
            pick = rng.choice(len(candidates), p=rates / rates.sum())
            return candidates[int(pick)][1]
        fastest = min(est for est, _ in candidates)
        near = [node for est, node in candidates if est <= fastest * (1.0 + self.tie_tolerance)]
        return near[int(rng.integers(len(near)))]


SCHEDULERS: dict[str, Callable[..., Scheduler]] = {
    RandomScheduler.name: RandomScheduler,
    CommunicationScheduler.name: CommunicationScheduler,
}


def get_scheduler(name: str, **kwargs: Any) -> Scheduler:
    """Build a scheduler by name: ``"random"`` or ``"scheduled"``."""
    try:
        factory = SCHEDULERS[name]
    except KeyError:
        raise ValueError(
            f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}"
        ) from None
    return factory(**kwargs)
