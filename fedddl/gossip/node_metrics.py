"""A gossip node's counters and their JSON form in :meth:`PeerNode.metrics`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["NodeCounters", "counter_metrics"]


@dataclass
class NodeCounters:
    """What a node sent, received and merged (the node updates it under its state lock)."""

    received_from: dict[int, int] = field(default_factory=dict)
    sent_to: dict[int, int] = field(default_factory=dict)
    merged: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    model_bytes_sent: int = 0
    send_failures: int = 0
    rate_limited: int = 0  # our model frames a peer refused as over its rate
    key_frames_sent: int = 0
    links_reset: int = 0
    held: int = 0  # frames held before training started
    held_dropped: int = 0  # of those, refused when training started
    transfer_s_sum: dict[int, float] = field(default_factory=dict)
    transfers: dict[int, int] = field(default_factory=dict)

    def count_transfer(self, peer: int, seconds: float) -> None:
        """One model frame to ``peer`` was acknowledged after ``seconds``."""
        self.transfer_s_sum[peer] = self.transfer_s_sum.get(peer, 0.0) + seconds
        self.transfers[peer] = self.transfers.get(peer, 0) + 1


def counter_metrics(counters: NodeCounters) -> dict[str, Any]:
    """The counters as :meth:`PeerNode.metrics` reports them (JSON-able, peer ids as str)."""
    return {
        "received": sum(counters.received_from.values()),
        "received_from": {str(k): v for k, v in counters.received_from.items()},
        "sent": sum(counters.sent_to.values()),
        "sent_to": {str(k): v for k, v in counters.sent_to.items()},
        "merged": counters.merged,
        "bytes_sent": counters.bytes_sent,
        "bytes_received": counters.bytes_received,
        "model_bytes_sent": counters.model_bytes_sent,
        "send_failures": counters.send_failures,
        "rate_limited": counters.rate_limited,
        "key_frames_sent": counters.key_frames_sent,
        "links_reset": counters.links_reset,
        "held": counters.held,
        "held_dropped": counters.held_dropped,
        "mean_transfer_s": {
            str(k): total / counters.transfers[k] for k, total in counters.transfer_s_sum.items()
        },
    }
