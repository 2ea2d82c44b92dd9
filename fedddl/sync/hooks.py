"""The override points of a replica server: what a variant such as TernGrad's changes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from fedddl.sync.aggregation import Aggregate, Contribution
from fedddl.sync.messages import ClientReply

__all__ = ["ServerHooks"]


class ServerHooks(Protocol):
    """The override points of a replica server (each has a default on the server)."""

    def compressor_name(self) -> str:
        """The uplink compressor clients use (and the server re-encodes with)."""

    def validate_reply(self, reply: ClientReply, expected_version: int | None) -> None:
        """Check one parsed reply against the round; raise a ``ReplyError`` to drop it."""

    def aggregate_gradients(self, contributions: Iterable[Contribution]) -> Aggregate:
        """Combine the admitted gradients (each in a buffer the next one overwrites)."""

    def encode_downlink(self, server_round: int, aggregate: Aggregate) -> tuple[bytes, str]:
        """The broadcast bytes of the aggregate, its pooled statistics included, and their
        format."""
