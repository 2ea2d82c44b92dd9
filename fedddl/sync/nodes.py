"""What the server knows about each client's replica.

:class:`NodeBook` keeps, per node, the replica version the server believes it holds,
the uplink compressor name it is known to hold (the name changes after fp32 warm-up
rounds), and the version it was told to reach this round. Its state changes only
through :meth:`NodeBook.sent` (a message went out) and :meth:`NodeBook.learn` (a reply
came back, valid or not), never as a side effect of validation.
"""

from __future__ import annotations

from fedddl.sync.errors import (
    FingerprintMismatch,
    ReplyError,
    ResyncRequest,
    UnexpectedReply,
    VersionMismatch,
)
from fedddl.sync.messages import ClientReply

__all__ = ["NodeBook"]


class NodeBook:
    """Per-node replica knowledge of the server.

    Parameters
    ----------
    unknown_version : int
        Version assumed for a node never heard from: 0 (it builds the seeded model
        itself) at a fresh start, -1 (send a snapshot) after a restore.
    """

    def __init__(self, unknown_version: int = 0) -> None:
        self.unknown_version = unknown_version
        self.version: dict[int, int] = {}
        self.compressor: dict[int, str] = {}
        self.expected: dict[int, int] = {}
        self._told: dict[int, str] = {}

    def known_version(self, node: int) -> int:
        """The version ``node`` is believed to hold (-1: no usable replica)."""
        return self.version.get(node, self.unknown_version)

    def needs_compressor(self, node: int, name: str) -> bool:
        """Whether the next message to ``node`` must name the uplink compressor ``name``."""
        return self.compressor.get(node) != name

    def sent(self, node: int, version: int, compressor: str) -> None:
        """``node`` was told to reach ``version`` this round and to use ``compressor``."""
        self.expected[node] = version
        self._told[node] = compressor

    def expected_version(self, node: int) -> int | None:
        """The version ``node`` was told to reach this round (None: not sent or answered)."""
        return self.expected.get(node)

    def learn(self, reply: ClientReply, error: ReplyError | None) -> None:
        """Update the knowledge of ``reply.node_id`` from its reply and its verdict.

        ``error`` is None for an accepted reply, else the reason it was dropped. Each node
        answers once per round: its expectation is consumed here.
        """
        node = reply.node_id
        if isinstance(error, UnexpectedReply):
            return  # not ours to learn from: the node was not asked, or already answered
        expected = self.expected.pop(node, None)
        told = self._told.pop(node, None)
        if isinstance(error, ResyncRequest):
            self.version[node] = reply.model_version
            if reply.model_version < 0:
                self.compressor.pop(node, None)
            return
        if isinstance(error, VersionMismatch):
            self.version[node] = reply.model_version
            return
        if told is not None:
            self.compressor[node] = told
        if isinstance(error, FingerprintMismatch):
            self.version[node] = -1  # diverged replica: resync with a snapshot
        elif expected is not None:
            self.version[node] = expected

    def end_round(self) -> None:
        """Forget this round's expectations (nodes that never answered)."""
        self.expected.clear()
        self._told.clear()

    def forget(self, unknown_version: int) -> None:
        """Forget everything (after a restore every node first gets a snapshot)."""
        self.version.clear()
        self.compressor.clear()
        self.expected.clear()
        self._told.clear()
        self.unknown_version = unknown_version
