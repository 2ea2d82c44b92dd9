"""The fixed test subset gossip nodes evaluate on, the same in the simulator and real peers."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["eval_subset"]


def eval_subset(x_test: torch.Tensor, y_test: torch.Tensor, samples: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` test examples drawn once from ``seed`` (in their original order).

    ``samples`` 0 or at least the test set's size keeps the whole test set. The same
    ``(samples, seed)`` always selects the same examples, so a simulation and real peers
    with the same settings evaluate on the same images.
    """
    if samples < 0:
        raise ValueError(f"eval samples must be >= 0 (0: all), got {samples}")
    if not 0 < samples < x_test.shape[0]:
        return x_test, y_test
    rng = np.random.default_rng(seed)
    keep = torch.from_numpy(np.sort(rng.choice(x_test.shape[0], samples, False)))
    return x_test[keep], y_test[keep]
