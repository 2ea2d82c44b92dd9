"""What a gossip node received since its last merge: neighbours' models and edge updates.

:class:`Inbox` keeps the newest model of each neighbour (uncompressed gossip) and the sum of
the compressed edge updates (compressed gossip) until the training thread takes them all at
once. Not thread-safe: the node calls it under its state lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["Inbox", "Received"]

Tensors = dict[str, torch.Tensor]


@dataclass
class Received:
    """What :meth:`Inbox.take` hands over: models by sender with their versions, the summed
    edge updates (None: none), how many were summed and their newest version."""

    models: dict[int, tuple[Tensors, int]] = field(default_factory=dict)
    correction: Tensors | None = None
    corrections: int = 0
    correction_version: int = 0

    def __len__(self) -> int:
        """How many updates: models plus summed edge updates."""
        return len(self.models) + self.corrections


class Inbox:
    """Received updates waiting for the next merge (see the module docstring)."""

    def __init__(self) -> None:
        self._received = Received()

    def __len__(self) -> int:
        """How many updates wait."""
        return len(self._received)

    def add_model(self, sender: int, tensors: Tensors, version: int) -> None:
        """Keep ``sender``'s model at ``version`` (replacing an older one not merged yet)."""
        self._received.models[sender] = (tensors, version)

    def add_correction(self, correction: Mapping[str, torch.Tensor], version: int | None) -> None:
        """Add an edge update (``version``: the sender's, None for one's own side)."""
        received = self._received
        if received.correction is None:
            received.correction = {k: v.clone() for k, v in correction.items()}
        else:
            for name, value in correction.items():
                received.correction[name] += value
        received.corrections += 1
        if version is not None:
            received.correction_version = max(received.correction_version, version)

    def take(self) -> Received:
        """Everything received since the last take; the inbox is empty afterwards (the
        newest edge-update version carries over, as a clock)."""
        taken = self._received
        self._received = Received(correction_version=taken.correction_version)
        return taken
