"""Partner selection for gossip SGD: classic random gossip and communication scheduling.

What every node shares (:class:`PeerState`)
-------------------------------------------
``node_id``
    Who it is.
``enabled``
    *Communication-enabled*: its downlink is free, i.e. it is not receiving a
    model right now, so a model sent to it starts moving at once instead of
    queueing behind another one.
``model_version``
    A step clock of its model: +1 per local SGD step, and ``max(own, received)``
    after a merge (a Lamport clock over SGD steps), so it says how many steps of
    training the newest information in the model stems from.
``est_comm_time_s``
    Its own estimate (:class:`~fedddl.gossip.estimator.CommTimeEstimator`) of
    the time to send *one model message* to each peer it knows.
``steps_per_s``
    Its local training speed in SGD steps per second (``0`` = unknown), used to
    predict how far it will have advanced when a model sent now arrives.

The state travels as a small fixed-layout status message (:meth:`PeerState.to_bytes`,
``21 + 8 * len(est_comm_time_s)`` bytes) that a node broadcasts to all peers
whenever ``enabled`` flips; the same bytes can ride on a model message.

How :class:`CommunicationScheduler` picks a partner
--------------------------------------------------
Called when a node has a new model to share and its uplink is free:

1. Candidates are the *other* nodes whose last known state is ``enabled``; a
   disabled node is never chosen.
2. The transfer time to each candidate is the node's own estimate when it has
   observed that link, else the candidate's shared estimate of the reverse link
   (links are assumed roughly symmetric), else the estimator's prior.
3. A candidate is skipped when the model would arrive *stale*: with
   ``lag = v_peer + steps_per_s_peer * est_time - v_me`` (the peer's predicted
   clock at arrival minus the clock of the model we send), skip if
   ``lag > stale_threshold_steps``.
4. Among the rest, with ``selection="proportional"`` (the default) choose peer
   ``p`` with probability proportional to ``1 / est_p`` (seeded ``rng``): fast
   links carry most messages, yet every peer gets the same share of uplink
   *time*, so slow (e.g. cross-region) links keep mixing the models -- always
   taking the fastest link splits a WAN into regions that never mix.  With
   ``selection="fastest"`` choose uniformly among the peers whose estimate is
   within ``(1 + tie_tolerance)`` of the smallest one.
5. No candidate left: return ``None`` and the caller defers the send to its next
   step, when it will have a newer model anyway.

Never queueing a model behind a busy uplink (the caller only asks when its
uplink is free) is the other half of "a newer model would be ready first": a
model is only sent when it is the newest one the node has.

:class:`RandomScheduler` is classic gossip: a uniformly random other node,
ignoring every shared state.
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
    """What a node shares about itself (see the module docstring)."""

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
        """Return the peer to send the current model to, or ``None`` to defer.

        Parameters
        ----------
        me
            The choosing node; an entry ``peers[me]`` (its own state) is used
            for its model version and is never chosen.
        peers
            Last known state of each node.
        model_bytes
            Size of the model message.
        estimator
            The choosing node's transfer-time estimator.
        rng
            Source of randomness (seeded by the caller for reproducibility).
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
    """The communication-scheduling method (Shudo et al.); see the module docstring.

    Parameters
    ----------
    stale_threshold_steps
        Skip a peer whose predicted clock at arrival exceeds our model's clock
        by more than this many steps.
    tie_tolerance
        Peers whose estimate is within ``(1 + tie_tolerance)`` of the fastest
        are treated as equally fast.
    selection
        ``"fastest"`` or ``"proportional"`` (step 4 of the module docstring).
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
