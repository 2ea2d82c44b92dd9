"""What the ServerApp asks of a strategy that keeps a shadow replica.

The ServerApp runs any Flower :class:`~flwr.serverapp.strategy.Strategy`. A strategy that
also implements :class:`ReplicaStrategy` (the TernGrad family does) gets more from it:
per-round reports in the results (accepted and dropped replies, replica agreement), the
final version and fingerprint, checkpoints and resume. :func:`replica_strategy` is the one
place that asks.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from flwr.serverapp.strategy import Strategy
from torch import nn

from fedddl.checkpoint import ServerCheckpoint
from fedddl.sync.report import RoundReport

__all__ = ["ReplicaStrategy", "replica_strategy"]


@runtime_checkable
class ReplicaStrategy(Protocol):
    """The documented interface between the ServerApp and a replica-keeping strategy."""

    def round_report(self) -> RoundReport | None:
        """The report of the latest aggregated round (None before the first)."""

    def global_model(self) -> nn.Module:
        """The model every client replica equals (evaluated by the ServerApp)."""

    def model_version(self) -> int:
        """The number of updates applied to :meth:`global_model`."""

    def checkpoint(self, server_round: int, config: dict[str, object]) -> ServerCheckpoint:
        """The state to save after global round ``server_round``."""

    def restore(self, ckpt: ServerCheckpoint) -> None:
        """Continue from ``ckpt`` (raises ``CheckpointError`` and changes nothing if unfit)."""


def replica_strategy(strategy: Strategy) -> ReplicaStrategy | None:
    """``strategy`` as a :class:`ReplicaStrategy`, or None when it does not implement one."""
    return strategy if isinstance(strategy, ReplicaStrategy) else None
