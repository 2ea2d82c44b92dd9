"""Range checks of the sizes and counts of a run config (:class:`fedddl.app_config.AppConfig`)."""

from __future__ import annotations

import os
from typing import Protocol

__all__ = ["RunSizes", "check_run_sizes"]


class RunSizes(Protocol):
    """The fields :func:`check_run_sizes` reads (an ``AppConfig`` has them all)."""

    @property
    def batch_size(self) -> int: ...
    @property
    def local_steps(self) -> int: ...
    @property
    def fraction_train(self) -> float: ...
    @property
    def dirichlet_alpha(self) -> float: ...
    @property
    def clip_sigma(self) -> float: ...
    @property
    def client_snapshot_dir(self) -> str: ...
    @property
    def update_log_size(self) -> int: ...
    @property
    def grid_levels(self) -> int: ...
    @property
    def grid_log_size(self) -> int: ...
    @property
    def min_available_nodes(self) -> int: ...
    @property
    def min_replies(self) -> int: ...
    @property
    def checkpoint_every(self) -> int: ...
    @property
    def checkpoint_keep(self) -> int: ...
    @property
    def checkpoint_dir(self) -> str: ...
    @property
    def fp32_min_numel(self) -> int: ...
    @property
    def fp32_warmup_rounds(self) -> int: ...


def check_run_sizes(cfg: RunSizes) -> None:
    """Check the sizes, counts, rates and paths of ``cfg`` (batch-size to fp32-warmup-rounds).

    Raises
    ------
    ValueError
        Naming the first bad key (kebab-case).
    """
    if cfg.batch_size < 1:
        raise ValueError(f"batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.local_steps < 1:
        raise ValueError(f"local-steps must be >= 1, got {cfg.local_steps}")
    if not 0 < cfg.fraction_train <= 1:
        raise ValueError(f"fraction-train must be in (0, 1], got {cfg.fraction_train}")
    if not cfg.dirichlet_alpha > 0:
        raise ValueError(f"dirichlet-alpha must be > 0, got {cfg.dirichlet_alpha}")
    if not cfg.clip_sigma > 0:
        raise ValueError(f"clip-sigma must be > 0, got {cfg.clip_sigma}")
    if cfg.client_snapshot_dir not in ("auto", "state") and not os.path.isabs(
        cfg.client_snapshot_dir
    ):
        raise ValueError(
            "client-snapshot-dir must be 'auto', 'state' or an absolute directory "
            f"(every client process resolves it), got {cfg.client_snapshot_dir!r}"
        )
    if cfg.update_log_size < 0:
        raise ValueError(f"update-log-size must be >= 0, got {cfg.update_log_size}")
    if not 1 <= cfg.grid_levels <= 127:
        raise ValueError(f"grid-levels must be in [1, 127], got {cfg.grid_levels}")
    if not 1 <= cfg.grid_log_size <= 2**20:
        raise ValueError(f"grid-log-size must be in [1, 2**20], got {cfg.grid_log_size}")
    if cfg.min_available_nodes < 1:
        raise ValueError(f"min-available-nodes must be >= 1, got {cfg.min_available_nodes}")
    if cfg.min_replies < 1:
        raise ValueError(f"min-replies must be >= 1, got {cfg.min_replies}")
    if cfg.checkpoint_every < 0:
        raise ValueError(f"checkpoint-every must be >= 0, got {cfg.checkpoint_every}")
    if cfg.checkpoint_keep < 1:
        raise ValueError(f"checkpoint-keep must be >= 1, got {cfg.checkpoint_keep}")
    if cfg.checkpoint_every > 0 and not cfg.checkpoint_dir:
        raise ValueError("checkpoint-every > 0 needs a checkpoint-dir")
    if cfg.fp32_min_numel < 0:
        raise ValueError(f"fp32-min-numel must be >= 0, got {cfg.fp32_min_numel}")
    if cfg.fp32_warmup_rounds < 0:
        raise ValueError(f"fp32-warmup-rounds must be >= 0, got {cfg.fp32_warmup_rounds}")
