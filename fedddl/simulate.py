"""Moved to :mod:`fedddl.flower.simulation` (this path keeps working for one release).

``fedddl.simulate.run(config, num_clients=10)`` runs one in-process Flower simulation.
"""

from __future__ import annotations

from fedddl.flower.simulation import ray_failed_to_start, run

__all__ = ["ray_failed_to_start", "run"]
