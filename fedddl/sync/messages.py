"""What the server and a client of the localized-replica protocol tell each other.

Flower-free values: :mod:`fedddl.flower.protocol` turns them into Flower records and
back, :class:`~fedddl.sync.server.ReplicaServer` and :mod:`fedddl.sync.worker` act on
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedddl.sync.errors import ReplyError

__all__ = [
    "FINGERPRINT_BYTES",
    "ClientReply",
    "ParseFailure",
    "TrainInstruction",
    "fingerprint_prefix",
]

#: Bytes of the sha256 fingerprint a client reports (a 128-bit prefix keeps replies small).
FINGERPRINT_BYTES = 16


def fingerprint_prefix(fingerprint_hex: str) -> bytes:
    """The first :data:`FINGERPRINT_BYTES` bytes of a hex sha256 fingerprint.

    Raises
    ------
    ValueError
        If the fingerprint is shorter.
    """
    raw = bytes.fromhex(fingerprint_hex)
    if len(raw) < FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must have >= {FINGERPRINT_BYTES} bytes, got {len(raw)}")
    return raw[:FINGERPRINT_BYTES]


@dataclass(frozen=True)
class TrainInstruction:
    """What one server message asks of a client.

    Attributes
    ----------
    server_round : int
        Current (global) round.
    model_version : int
        Version the client must hold before computing its gradient.
    updates : list[tuple[int, bytes]]
        ``(version, encoded broadcast update)`` to apply, oldest first.
    snapshot : dict[str, torch.Tensor] | None
        Replica snapshot to load first, with ``snapshot_version``.
    snapshot_version : int
        Version of ``snapshot`` (-1 without one).
    compressor : str | None
        Uplink compressor name, when sent.
    scales : torch.Tensor | None
        Shared per-tensor ternary scales (``float32``), in parameter order.
    want_scales : bool
        Whether the reply must carry the client's local per-tensor scales.
    """

    server_round: int
    model_version: int
    updates: list[tuple[int, bytes]]
    snapshot: dict[str, torch.Tensor] | None = None
    snapshot_version: int = -1
    compressor: str | None = None
    scales: torch.Tensor | None = None
    want_scales: bool = False


@dataclass(frozen=True)
class ClientReply:
    """A parsed client reply.

    Attributes
    ----------
    node_id : int
        Sender.
    model_version : int
        Version of the client's replica (-1: no state).
    fingerprint : str
        Hex of the first :data:`FINGERPRINT_BYTES` bytes of the replica's fingerprint
        ('' on resync).
    payload : bytes | None
        Encoded gradient; None when the client asks to resync.
    num_examples : int
        Examples used.
    loss : float
        Mean training loss over the local steps.
    scales : torch.Tensor | None
        The client's local per-tensor scales (shared-scale downlink only).
    statistics : bytes | None
        Encoded BatchNorm input statistics of the local minibatches
        (:mod:`fedddl.running_stats`; identity-compressed :func:`encode_update` bytes), for
        models with BatchNorm layers.
    partition_id : int | None
        The data partition the client reports (its ``node_config["partition-id"]``): the
        server combines replies in this order, which is the same in every run, unlike node
        ids (random in Flower's simulation) and arrival order. None: not reported.
    """

    node_id: int
    model_version: int
    fingerprint: str
    payload: bytes | None
    num_examples: int
    loss: float
    scales: torch.Tensor | None = None
    statistics: bytes | None = None
    partition_id: int | None = None

    @property
    def resync(self) -> bool:
        """Whether the client could not catch up and sent no gradient."""
        return self.payload is None

    @classmethod
    def resync_request(cls, node_id: int, model_version: int) -> ClientReply:
        """The reply of a client that cannot reach the requested version."""
        return cls(node_id, model_version, "", None, 0, math.nan)


@dataclass(frozen=True)
class ParseFailure:
    """A reply that could not even be parsed (error reply, missing or malformed records)."""

    node_id: int
    error: ReplyError
