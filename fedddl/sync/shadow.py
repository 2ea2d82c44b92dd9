"""The server's shadow replica: the model every client replica equals at the same version.

It keeps the bounded log of broadcast updates (for catch-up), the fingerprints of recent
versions (to check replies), one reusable decode buffer per trainable parameter, and its
checkpoints (:mod:`fedddl.sync.checkpoints`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, getLogger
from typing import Any

import torch

from fedddl.checkpoint import ServerCheckpoint
from fedddl.compression import ResidualMemory
from fedddl.compression.codecs.downlink import decode_broadcast_parts
from fedddl.replica import CatchUp, Replica, UpdateLog, plan_catch_up
from fedddl.sync.checkpoints import Restored
from fedddl.sync.checkpoints import capture as capture_checkpoint
from fedddl.sync.checkpoints import load as load_checkpoint

__all__ = ["ShadowReplica"]

logger = getLogger("fedddl")


class ShadowReplica:
    """A versioned replica with its update log and fingerprints.

    Attributes
    ----------
    replica : Replica
        The server's replica (replaced on restore).
    log : UpdateLog
        Encoded broadcast updates, by the version they produce.
    fingerprints : OrderedDict[int, str]
        Fingerprints of recent versions.
    param_names : list[str]
        The trainable parameters, in order.
    """

    def __init__(self, replica: Replica, log_size: int) -> None:
        self.replica = replica
        self.log = UpdateLog(log_size)
        self.fingerprints: OrderedDict[int, str] = OrderedDict(
            {replica.version: replica.fingerprint()}
        )
        self.param_names = [n for n, p in replica.model.named_parameters() if p.requires_grad]
        self._buffers: dict[str, torch.Tensor] | None = None

    def buffers(self) -> dict[str, torch.Tensor]:
        """One float32 CPU buffer per trainable parameter, reused by every reply and round."""
        if self._buffers is None:
            self._buffers = {
                n: torch.zeros(p.shape, dtype=torch.float32)
                for n, p in self.replica.model.named_parameters()
                if p.requires_grad
            }
        return self._buffers

    def apply(self, payload: bytes) -> None:
        """Apply a broadcast exactly as the clients will and log it as the next version;
        raises before changing the replica if it does not decode or apply."""
        # decoded into the reply buffers (free by now; the replica copies what it applies)
        update, statistics = decode_broadcast_parts(payload, out=self.buffers())
        self.replica.apply_update(update, self.replica.version + 1, statistics)
        self.log.append(self.replica.version, payload)
        self.fingerprints[self.replica.version] = self.replica.fingerprint()
        while len(self.fingerprints) > max(64, 2 * len(self.log) + 2):
            self.fingerprints.popitem(last=False)

    def catch_up(self, known: int) -> CatchUp:
        """How a node at version ``known`` (-1: no state) reaches the current version."""
        return plan_catch_up(known, self.replica.version, self.log)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A snapshot of the replica (weights and momentum)."""
        return self.replica.snapshot()

    def checkpoint(
        self,
        server_round: int,
        config: dict[str, object],
        *,
        memory: ResidualMemory,
        shared_scales: torch.Tensor | None,
        owner: str,
        extra: Mapping[str, Any],
    ) -> ServerCheckpoint:
        """The checkpoint after global round ``server_round``: replica, optimiser, version,
        log, the downlink state given and ``extra`` plain-typed state."""
        return capture_checkpoint(
            self.replica,
            self.log,
            memory,
            shared_scales,
            server_round=server_round,
            config=config,
            owner=owner,
            extra=extra,
        )

    def load(self, ckpt: ServerCheckpoint, owner: str) -> Restored:
        """``ckpt`` checked against this replica, as state to :meth:`adopt` (nothing changes
        here; raises ``CheckpointError`` if it does not fit)."""
        return load_checkpoint(ckpt, self.replica, self.log.capacity, owner, self.param_names)

    def adopt(self, restored: Restored, ckpt: ServerCheckpoint) -> None:
        """Continue from ``restored`` (loaded from ``ckpt``): replica, log, torch's random
        state; fingerprints start at its version."""
        self.replica = restored.shadow
        self.log = restored.log
        self.fingerprints = OrderedDict({self.replica.version: self.replica.fingerprint()})
        rng = (ckpt.rng_states or {}).get("torch")
        if isinstance(rng, torch.Tensor):
            torch.set_rng_state(rng)
        logger.log(
            INFO,
            "restored from checkpoint: round %d, version %d, %d logged updates",
            ckpt.round,
            ckpt.version,
            len(self.log),
        )
