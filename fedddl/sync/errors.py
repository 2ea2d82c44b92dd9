"""Why the server drops a client reply: one exception class per reason.

Every class is a :class:`ReplyError` (a ``ValueError``); the server logs the message,
leaves the reply out of the round and updates what it knows about the node from the
class (see :meth:`fedddl.sync.nodes.NodeBook.learn`).
"""

from __future__ import annotations

__all__ = [
    "FingerprintMismatch",
    "OpposedDirection",
    "PayloadRejected",
    "ReplyError",
    "ResyncRequest",
    "UnexpectedReply",
    "VersionMismatch",
]


class ReplyError(ValueError):
    """A client reply is malformed or does not fit the round (the message says which)."""


class UnexpectedReply(ReplyError):
    """The node was not sent a message this round, or already replied."""


class ResyncRequest(ReplyError):
    """The client could not reach the requested version and sent no gradient."""


class VersionMismatch(ReplyError):
    """The client computed on another version than the one it was told to reach."""


class FingerprintMismatch(ReplyError):
    """A client's replica differs from the shadow replica at the same version."""


class PayloadRejected(ReplyError):
    """The encoded gradient does not decode, or does not fit the model."""


class OpposedDirection(ReplyError):
    """The gradient's signs oppose the other replies' majority (:mod:`fedddl.sync.direction`)."""
