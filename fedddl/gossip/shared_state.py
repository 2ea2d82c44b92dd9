"""What a gossip node's receiving half and its sending half share, and the locks that guard it.

A :class:`~fedddl.gossip.peer_node.PeerNode` receives and merges frames; its
:class:`~fedddl.gossip.sender.Sender` ships models and states. Both read and write the
same peer states, clients, counters and inbox, and the same compressed-gossip links: they
hold them in one :class:`SharedState` rather than in each other's attributes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fedddl.gossip.compressed import CompressedGossip
from fedddl.gossip.inbox import Inbox
from fedddl.gossip.node_metrics import NodeCounters
from fedddl.gossip.scheduler import PeerState
from fedddl.gossip.transport import PeerClient

__all__ = ["SharedState"]


@dataclass
class SharedState:
    """The state both halves of a gossip node use.

    ``state_lock`` guards ``frame_bytes``, ``peer_states``, ``clients``, ``counters`` and
    ``inbox`` (and the node's estimator and the sender's backoff); ``links_lock`` guards
    ``gossip`` (compressed gossip's public copies; ``None``: whole models are sent).
    ``stop`` asks every thread to stop; ``done`` is set once training has ended.
    """

    frame_bytes: int  # size of this node's model frame, as the scheduler plans with it
    gossip: CompressedGossip | None = None
    peer_states: dict[int, PeerState] = field(default_factory=dict)
    clients: dict[int, PeerClient] = field(default_factory=dict)
    counters: NodeCounters = field(default_factory=NodeCounters)
    inbox: Inbox = field(default_factory=Inbox)
    state_lock: threading.Lock = field(default_factory=threading.Lock)
    links_lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
