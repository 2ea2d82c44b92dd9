"""A gossip node's settings (:class:`NodeConfig`) and its data (:class:`TrainingData`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedddl.gossip.admission import AdmissionLimits
from fedddl.gossip.attack import GOSSIP_ATTACKS
from fedddl.gossip.clip import DEFAULT_CLIP
from fedddl.gossip.scheduler import get_scheduler
from fedddl.gossip.wire import DEFAULT_MAX_FRAME_BYTES

__all__ = ["NodeConfig", "TrainingData"]


@dataclass(frozen=True)
class NodeConfig:
    """Settings of one gossip node (see ``python -m fedddl.gossip.peer --help``)."""

    node_id: int
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 0.1
    scheduler: str = "scheduled"
    merge: str = "average"  # "average" (weight 0.5) or "version" (age-weighted)
    eval_every: int = 25
    min_step_s: float = 0.0  # pace steps to emulate slower compute
    send_timeout_s: float = 2.0
    overlap: bool = True  # compute while sending; False: wait for each send after a step
    state_interval_s: float = 0.2
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    seed: int = 0
    compressor: str = ""  # "" = whole fp32 models; else compressed differences (DELTA)
    consensus_step: float = 0.25  # edge-update step of compressed gossip
    scale_bucket: int = 0  # scale buckets of a ternary compressor (0: one per tensor)
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    hold_limit: int = 64  # frames held before training starts
    clip: float = DEFAULT_CLIP  # clipped gossip multiplier (fedddl.gossip.clip); 0 = off
    attack: str = ""  # a compromised node: sends this poison (fedddl.gossip.attack)
    attack_scale: float | None = None

    def __post_init__(self) -> None:
        checks = {
            "node_id": self.node_id >= 0,
            "steps": self.steps >= 0,
            "batch_size": self.batch_size >= 1,
            "learning_rate": self.learning_rate > 0,
            "eval_every": self.eval_every >= 1,
            "min_step_s": self.min_step_s >= 0,
            "send_timeout_s": self.send_timeout_s > 0,
            "state_interval_s": self.state_interval_s > 0,
            "max_frame_bytes": self.max_frame_bytes > 0,
            "consensus_step": 0 < self.consensus_step <= 1,
            "scale_bucket": self.scale_bucket >= -1,
            "hold_limit": self.hold_limit >= 0,
            "clip": self.clip >= 0 and math.isfinite(self.clip),
            "attack": not self.attack or self.attack in GOSSIP_ATTACKS,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"NodeConfig.{name} is out of range: {getattr(self, name)!r}")
        if self.merge not in ("average", "version"):
            raise ValueError(f"NodeConfig.merge must be 'average' or 'version', got {self.merge!r}")
        if self.compressor and self.merge != "average":
            raise ValueError(
                "NodeConfig.merge applies to uncompressed gossip only; compressed gossip "
                "merges by edge updates (consensus_step)"
            )
        get_scheduler(self.scheduler)  # fails early on an unknown name
        if self.compressor:
            from fedddl.compression import available_compressors

            if self.compressor not in available_compressors():
                raise ValueError(
                    f"NodeConfig.compressor {self.compressor!r} is not registered; "
                    f"choose one of {available_compressors()}"
                )


@dataclass
class TrainingData:
    """The node's shard and the shared test set, as tensors."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
