"""Gossip SGD: transfer-time estimation, partner scheduling, merging, simulation.

The estimator, schedulers and merge are shared by the discrete-event
simulator (:mod:`fedddl.gossip.simulator`) and the real gRPC peers.  The
simulator's names (``run_gossip``, ``GossipConfig``, ``GossipSimulation``) load
lazily, so importing this package does not pull in data, models and compression.
"""

from typing import TYPE_CHECKING, Any

from fedddl.gossip.estimator import CommTimeEstimator
from fedddl.gossip.merge import merge_models, version_weight
from fedddl.gossip.scheduler import (
    SCHEDULERS,
    CommunicationScheduler,
    PeerState,
    RandomScheduler,
    Scheduler,
    get_scheduler,
)

if TYPE_CHECKING:
    from fedddl.gossip.sim_config import GossipConfig
    from fedddl.gossip.simulator import GossipSimulation, run_gossip

_LAZY = {
    "GossipConfig": "fedddl.gossip.sim_config",
    "GossipSimulation": "fedddl.gossip.simulator",
    "run_gossip": "fedddl.gossip.simulator",
}

__all__ = [
    "SCHEDULERS",
    "CommTimeEstimator",
    "CommunicationScheduler",
    "GossipConfig",
    "GossipSimulation",
    "PeerState",
    "RandomScheduler",
    "Scheduler",
    "get_scheduler",
    "merge_models",
    "run_gossip",
    "version_weight",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedddl.gossip' has no attribute {name!r}")
