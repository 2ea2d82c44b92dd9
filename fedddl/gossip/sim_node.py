"""One simulated gossip node: a real model trained by plain SGD on its own shard."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fedddl.gossip.compressed import add_correction
from fedddl.gossip.merge import merge_models
from fedddl.training import compute_gradients, iterate_minibatches

__all__ = ["SimNode"]


class SimNode:
    """A node's model, data stream and step clock.

    Parameters
    ----------
    node_id
        Index of the node.
    model
        Its own model (not shared with other nodes).
    x, y
        Its shard, in memory.
    batch_size, lr
        Plain SGD settings.
    step_time_s
        Virtual seconds one SGD step takes on this node.
    seed
        Seed of its minibatch order.
    """

    def __init__(
        self,
        node_id: int,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        batch_size: int,
        lr: float,
        step_time_s: float,
        seed: int,
    ) -> None:
        self.node_id = node_id
        self.model = model
        self.lr = lr
        self.step_time_s = step_time_s
        self.batches = iterate_minibatches(
            x, y, min(batch_size, x.shape[0]), torch.Generator().manual_seed(seed)
        )
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.steps = 0  # local SGD steps done
        self.version = 0  # step clock: +1 per step, max(own, received) on merge

    def sgd_step(self) -> float:
        """One real SGD step on the next minibatch; returns the loss."""
        xb, yb = next(self.batches)
        loss = compute_gradients(self.model, xb, yb)
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)
        self.steps += 1
        self.version += 1
        return loss

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copy of the current state (what goes on the wire)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def merge(self, received: Mapping[str, torch.Tensor], version: int, weight: float) -> None:
        """Average ``received`` into the model and advance the step clock."""
        merged = merge_models(self.model.state_dict(), received, weight)
        self.model.load_state_dict(merged)
        self.version = max(self.version, version)

    def correct(self, correction: Mapping[str, torch.Tensor], version: int | None) -> None:
        """Add a consensus correction (compressed gossip); advance the clock to ``version``."""
        self.model.load_state_dict(add_correction(self.model.state_dict(), correction))
        if version is not None:
            self.version = max(self.version, version)
