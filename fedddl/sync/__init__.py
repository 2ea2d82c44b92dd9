"""The localized-replica protocol without Flower: what the server and clients do.

* :mod:`fedddl.sync.messages`: the instruction a client gets and the reply it sends;
* :mod:`fedddl.sync.server`: :class:`ReplicaServer`, the server, composed of a catch-up
  planner (:mod:`~fedddl.sync.catch_up`), reply admission (:mod:`~fedddl.sync.admission`),
  aggregation and downlink (:mod:`~fedddl.sync.broadcast`) and the shadow replica with its
  checkpoints (:mod:`~fedddl.sync.shadow`);
* :mod:`fedddl.sync.worker`: the client's replica, its catch-up and its encoded gradient
  (journaled updates replayed by :mod:`fedddl.sync.journal`);
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
from fedddl.sync.messages import FINGERPRINT_BYTES, ClientReply, ParseFailure, TrainInstruction
from fedddl.sync.report import RoundReport
from fedddl.sync.server import DOWNLINKS, ReplicaServer

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
