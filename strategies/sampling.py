"""Node sampling of the TernGrad family: seeded per round, with a bounded wait.

Flower's own ``flwr.serverapp.strategy.strategy_utils.sample_nodes`` waits without a
deadline and samples with the process-global ``random`` module; a TernGrad run must be
reproducible and resumable (the sample of global round r depends only on the run seed,
r and the connected nodes) and must fail clearly when nodes never connect, so it samples
here. The sample size follows Flower's rule: ``floor(fraction * connected)``, at least 1.
"""

from __future__ import annotations

import random
import time
from logging import INFO

from flwr.common.logger import log
from flwr.serverapp import Grid

from fedddl.seeding import derive_seed

__all__ = ["sample_nodes"]


def sample_nodes(
    grid: Grid,
    *,
    fraction: float,
    min_available_nodes: int,
    seed: int,
    server_round: int,
    wait_timeout: float,
) -> list[int]:
    """Wait for ``min_available_nodes`` connected nodes, then sample a sorted subset.

    Raises
    ------
    TimeoutError
        If fewer than ``min_available_nodes`` are connected after ``wait_timeout`` seconds.
    """
    deadline = time.monotonic() + wait_timeout
    while len(nodes := sorted(grid.get_node_ids())) < min_available_nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(nodes)} nodes connected after {wait_timeout}s, "
                f"need {min_available_nodes}"
            )
        log(INFO, "Waiting for nodes: %d of %d", len(nodes), min_available_nodes)
        time.sleep(1)
    k = max(1, int(len(nodes) * fraction + 1e-9))  # as Flower: floor, >= 1
    if k >= len(nodes):
        return nodes
    rng = random.Random(derive_seed(seed, server_round, 17))
    return sorted(rng.sample(nodes, k))
