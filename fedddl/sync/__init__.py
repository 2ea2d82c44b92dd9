"""The localized-replica protocol without Flower: what the server and clients do.

* :mod:`fedddl.sync.messages`: the instruction a client gets and the reply it sends;
* :mod:`fedddl.sync.server`: :class:`ReplicaServer`, the server's shadow replica,
  catch-up plans, reply checks, aggregation and downlink;
* :mod:`fedddl.sync.worker`: the client's replica, its catch-up and its encoded gradient;
* :mod:`fedddl.sync.nodes`, :mod:`fedddl.sync.aggregation`, :mod:`fedddl.sync.errors`,
  :mod:`fedddl.sync.report`: the pieces they use.

:mod:`fedddl.flower.protocol` turns the messages into Flower records and back.
"""

from fedddl.sync.aggregation import Aggregate, Contribution, running_mean
from fedddl.sync.errors import (
    FingerprintMismatch,
    PayloadRejected,
    ReplyError,
    ResyncRequest,
    UnexpectedReply,
    VersionMismatch,
)
from fedddl.sync.messages import FINGERPRINT_BYTES, ClientReply, TrainInstruction
from fedddl.sync.report import RoundReport
from fedddl.sync.server import DOWNLINKS, ParseFailure, ReplicaServer

__all__ = [
    "DOWNLINKS",
    "FINGERPRINT_BYTES",
    "Aggregate",
    "ClientReply",
    "Contribution",
    "FingerprintMismatch",
    "ParseFailure",
    "PayloadRejected",
    "ReplicaServer",
    "ReplyError",
    "ResyncRequest",
    "RoundReport",
    "TrainInstruction",
    "UnexpectedReply",
    "VersionMismatch",
    "running_mean",
]
