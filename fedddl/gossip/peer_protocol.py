"""Names shared by the gossip coordinator (ServerApp side) and the client handler.

The coordinator steers each node with small ``query.gossip`` messages holding
one :class:`~flwr.app.ConfigRecord` named :data:`REQUEST_RECORD`; its ``op``
is one of :data:`OPS`. Replies hold a ConfigRecord :data:`REPLY_RECORD`
(status, address, text fields) and a MetricRecord :data:`METRICS_RECORD`
(numbers). No model bytes ever travel in these messages.
"""

from __future__ import annotations

__all__ = [
    "ACTION",
    "MESSAGE_TYPE",
    "METRICS_RECORD",
    "NUMERIC_METRICS",
    "OPS",
    "OP_HELLO",
    "OP_PEERS",
    "OP_START",
    "OP_STATUS",
    "OP_STOP",
    "REPLY_RECORD",
    "REQUEST_RECORD",
]

ACTION = "gossip"
MESSAGE_TYPE = f"query.{ACTION}"
REQUEST_RECORD = "gossip"
REPLY_RECORD = "gossip-reply"
METRICS_RECORD = "gossip-metrics"

OP_HELLO = "hello"  # reply with the gossip id the node pins (node config gossip-id), or -1
OP_START = "start"  # spawn (once) the node's peer process; reply with its address
OP_PEERS = "peers"  # hand the peer its peer list; it starts training
OP_STATUS = "status"  # reply with the peer's latest metrics
OP_STOP = "stop"  # SIGTERM the peer; reply with its final metrics
OPS = (OP_HELLO, OP_START, OP_PEERS, OP_STATUS, OP_STOP)

# Peer metrics (keys of PeerNode.metrics()) sent back as numbers.
NUMERIC_METRICS = (
    "steps",
    "target_steps",
    "model_version",
    "received",
    "sent",
    "merged",
    "bytes_sent",
    "bytes_received",
    "send_failures",
    "initial_accuracy",
    "final_accuracy",
    "steps_per_s",
    "model_bytes_sent",
    "rate_limited",
    "key_frames_sent",
    "links_reset",
    "held",
)
