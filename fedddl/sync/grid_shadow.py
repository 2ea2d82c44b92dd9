"""The server's shadow replica of the ``grid`` downlink: momentum, grid steps, catch-ups.

Each applied round: ``m = momentum * m + g`` (``g``: the round's aggregate; ``m = g`` at
first, as ``torch.optim.SGD``), the desired step ``-lr * m`` (``lr`` by the version the
round produces, :mod:`fedddl.lr_decay`) goes onto the grid
(:class:`~fedddl.sync.grid_quantizer.GridQuantizer`, error feedback), with a rebase when
the counts would overflow; the segment updates the server's
:class:`~fedddl.sync.grid_replica.GridReplica` and goes into a
:class:`~fedddl.sync.grid_log.GridLog`; the round's pooled BatchNorm statistics move the
shadow's buffers. A node at version ``v`` is caught up by one ``FDGU`` message (the counts
from ``v``, and the current buffers) while the log reaches ``v`` (or ``v = 0`` and no round
has rebased: then the counts since the seeded model), else by an ``FDGS`` snapshot.
Checkpoints hold all of it (:mod:`fedddl.sync.grid_checkpoints`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fedddl.checkpoint import ServerCheckpoint
from fedddl.compression import ResidualMemory
from fedddl.compression.codecs.count_delta import CountDelta
from fedddl.lr_decay import NO_DECAY, StepDecay
from fedddl.replica import CatchUp
from fedddl.running_stats import apply_statistics, check_statistics
from fedddl.sync.grid_checkpoints import GridRestored
from fedddl.sync.grid_checkpoints import capture as capture_checkpoint
from fedddl.sync.grid_checkpoints import load as load_checkpoint
from fedddl.sync.grid_log import GridLog
from fedddl.sync.grid_quantizer import GridQuantizer
from fedddl.sync.grid_replica import GridReplica
from fedddl.sync.report import RoundReport

__all__ = ["SNAPSHOT_KEY", "GridShadow"]

#: The one entry of a grid snapshot in :attr:`TrainInstruction.snapshot` (a uint8 tensor).
SNAPSHOT_KEY = "grid"


class GridShadow:
    """The server's grid replica, its momentum, quantizer, log and fingerprints.

    Parameters
    ----------
    model : torch.nn.Module
        The seeded initial model (owned).
    learning_rate, momentum, lr_decay :
        The run's SGD settings (applied here, not on the clients).
    levels : int
        Codes per round lie in ``[-levels, levels]``.
    seed : int
        Seeds the quantizer's stochastic rounding.
    log_size : int
        Rounds of updates kept for catch-ups.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        learning_rate: float,
        momentum: float,
        lr_decay: StepDecay = NO_DECAY,
        levels: int = 1,
        seed: int = 0,
        log_size: int = 256,
    ) -> None:
        self.replica = GridReplica(model)
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.lr_decay = lr_decay
        self.quantizer = GridQuantizer(levels, seed)
        self.log = GridLog(log_size, version=0)
        self.velocity: dict[str, torch.Tensor] = {}
        self.fingerprints: OrderedDict[int, str] = OrderedDict({0: self.replica.fingerprint()})
        self.param_names = list(self.replica.layout)
        self._buffers: dict[str, torch.Tensor] | None = None
        self._messages: dict[tuple[int, int], bytes] = {}
        #: Whether a round has rebased (the anchors are no longer the seeded model's).
        self.rebased = False

    def buffers(self) -> dict[str, torch.Tensor]:
        """One float32 CPU buffer per trainable parameter, reused by every reply and round."""
        if self._buffers is None:
            self._buffers = {
                n: torch.zeros(s, dtype=torch.float32) for n, s in self.replica.layout.items()
            }
        return self._buffers

    def apply_or_explain(
        self,
        gradient: Mapping[str, torch.Tensor],
        statistics: Mapping[str, torch.Tensor],
        report: RoundReport,
    ) -> str:
        """:meth:`step`, recording the format in ``report``; on failure change nothing and
        return why (hostile values that reached the aggregate)."""
        try:
            self.step(gradient, statistics)
        except Exception as err:
            report.downlink_format = "none"
            return f"the aggregate could not be applied on the grid: {type(err).__name__}: {err}"
        report.downlink_format = "grid"
        return ""

    def checkpoint(
        self,
        server_round: int,
        config: dict[str, object],
        *,
        memory: ResidualMemory,
        owner: str,
        extra: Mapping[str, Any],
    ) -> ServerCheckpoint:
        """The checkpoint after global round ``server_round``
        (:mod:`fedddl.sync.grid_checkpoints`)."""
        return capture_checkpoint(
            self.replica,
            self.log,
            self.quantizer,
            self.velocity,
            rebased=self.rebased,
            memory=memory,
            server_round=server_round,
            config=config,
            owner=owner,
            extra=extra,
        )

    def load(self, ckpt: ServerCheckpoint, owner: str) -> GridRestored:
        """``ckpt`` checked against this server, as state to :meth:`adopt` (nothing changes
        here; raises ``CheckpointError`` if it does not fit)."""
        return load_checkpoint(ckpt, self.replica, self.log.capacity, owner)

    def adopt(self, restored: GridRestored, ckpt: ServerCheckpoint) -> None:
        """Continue from ``restored`` (loaded from ``ckpt``): replica, log, momentum,
        quantizer, torch's random state; fingerprints start at its version."""
        self.replica = restored.replica
        self.log = restored.log
        self.velocity = dict(restored.velocity)
        self.quantizer.residuals = dict(restored.residuals)
        self.quantizer.exponents = dict(restored.exponents)
        self.rebased = restored.rebased
        self.fingerprints = OrderedDict({self.replica.version: self.replica.fingerprint()})
        self._messages.clear()
        rng = (ckpt.rng_states or {}).get("torch")
        if isinstance(rng, torch.Tensor):
            torch.set_rng_state(rng)

    def step(
        self, gradient: Mapping[str, torch.Tensor], statistics: Mapping[str, torch.Tensor]
    ) -> None:
        """Apply one round's aggregate (and pooled statistics) as the next version, all or
        nothing.

        Raises
        ------
        ValueError
            A gradient that is not finite, does not fit the model, or statistics that do
            not fit (nothing changed).
        """
        replica = self.replica
        layout = replica.layout
        if list(gradient) != list(layout):
            raise ValueError(
                f"grid step: gradient tensors {list(gradient)}, expected {list(layout)}"
            )
        if statistics or replica.batchnorm:
            check_statistics(replica.model, statistics, layers=replica.batchnorm)
        version = replica.version + 1
        rate = self.lr_decay.rate(self.learning_rate, version)
        velocity: dict[str, torch.Tensor] = {}
        for name, shape in layout.items():
            g = gradient[name].detach().to(device="cpu", dtype=torch.float32)
            if tuple(g.shape) != shape or not bool(torch.isfinite(g).all()):
                raise ValueError(f"grid step: {name!r} does not fit or is not finite")
            old = self.velocity.get(name)
            velocity[name] = (
                g.clone() if old is None or self.momentum == 0 else old * self.momentum + g
            )
        saved = (dict(self.quantizer.residuals), dict(self.quantizer.exponents))
        try:
            segment = self.quantizer.quantize(version, {n: -rate * v for n, v in velocity.items()})
            grid = replica.grid.copy()
            if grid.needs_rebase(segment):
                segment = replace(segment, rebase=True)
            grid.apply(segment)
        except Exception:
            self.quantizer.residuals, self.quantizer.exponents = saved
            raise
        self.velocity = velocity
        self.rebased = self.rebased or segment.rebase
        self.log.append(version, segment)
        replica.set_grid(grid, version)
        if statistics:
            apply_statistics(replica.model, statistics, layers=replica.batchnorm, checked=True)
        self.fingerprints[version] = replica.fingerprint()
        while len(self.fingerprints) > max(64, 2 * self.log.capacity + 2):
            self.fingerprints.popitem(last=False)
        self._messages.clear()

    def catch_up(self, known: int) -> CatchUp:
        """How a node at version ``known`` (-1: no state) reaches the current version: one
        ``FDGU`` message as ``[(current, bytes)]`` (kind ``"log"``), or ``"snapshot"``."""
        current = self.replica.version
        if known == current:
            return CatchUp("none", [])
        if 0 <= known < current:
            message = self._messages.get((known, current))
            if message is None:
                delta = self.log.catch_up(known, current)
                if delta is None and known == 0 and not self.rebased:
                    # the anchors are still the seeded model: the counts since then do
                    delta = CountDelta(0, current, (self.replica.grid.snapshot_segment(),))
                if delta is not None:
                    message = self.replica.catch_up_message(delta)
                    self._messages[(known, current)] = message
            if message is not None:
                return CatchUp("log", [(current, message)])
        return CatchUp("snapshot", [])

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The ``FDGS`` snapshot as :attr:`TrainInstruction.snapshot` carries it."""
        data = self.replica.snapshot_bytes()
        return {SNAPSHOT_KEY: torch.frombuffer(bytearray(data), dtype=torch.uint8)}
