"""Configuration of one gossip simulation run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedddl.gossip.attack import GOSSIP_ATTACKS
from fedddl.gossip.clip import DEFAULT_CLIP

__all__ = ["GossipConfig"]


@dataclass(frozen=True)
class GossipConfig:
    """Everything that determines a simulated gossip-SGD run.

    Attributes
    ----------
    scheduler
        ``"scheduled"`` (communication scheduling, overlapping) or ``"random"``
        (classic gossip, the sender waits for its send).
    network
        ``"homogeneous"``, ``"heterogeneous"`` or a network file (``fedddl.network``).
    nodes, dataset, data_root, partition, arch
        Data and models: one model per node on its own shard.
    target_accuracy
        Mean test accuracy whose first crossing gives ``time_to_target_s``.
    max_virtual_time_s
        Simulated duration.
    seed
        Seeds model init (same on all nodes), shards, minibatches, schedulers, network.
    lr, batch_size
        Plain SGD on every node.
    compute_time_s
        Virtual seconds per SGD step; ``None`` measures the real mean wall time
        of a step here (then the run is not bit-reproducible).
    compute_heterogeneity
        Node ``i`` takes ``compute_time_s * f_i`` with ``f_i`` uniform in ``[1, 1 + h]``.
    eval_interval_s
        Virtual time between evaluations of every node.
    eval_samples
        Fixed test subset size for evaluation (0 = whole test set).
    exchange_every
        Share the model after every ``k``-th local step.
    overlap
        Whether computing continues while a send is in flight; ``None`` = the
        scheduler's default (scheduled: yes, random: no).
    stale_threshold_steps
        A merge is *stale* when the receiver's step clock exceeds the received
        model's clock by more than this; also the scheduler's skip threshold.
    merge_weight
        Share of the received model in the average.
    estimator_alpha
        EWMA weight of the transfer-time estimators.
    stop_at_target
        End the run at the evaluation that reaches the target.
    selection
        Partner choice of the scheduled method: ``"proportional"`` (default) or ``"fastest"``.
    compressor
        ``""`` (default): every message is the whole fp32 model.  A registered
        compressor name (e.g. ``"ternary-base3"``): messages are compressed
        differences against the receiver's public copy
        (:mod:`fedddl.gossip.compressed`), and the scheduler plans with their size.
    consensus_step
        Step of the compressed gossip's edge updates (replaces ``merge_weight``
        when ``compressor`` is set).
    scale_bucket
        Scale buckets of a ternary ``compressor``: 0 one scale per tensor, ``N > 0`` per
        ``N`` values, -1 per output channel.
    downlink_holds_latency
        Whether a transfer occupies the receiver's downlink during its latency too
        (default, as published) or only while its bytes arrive
        (:class:`fedddl.network.LinkScheduler`; ``False`` matched real peers).
    clip
        Clipped gossip (:mod:`fedddl.gossip.clip`): a neighbour's difference is
        clipped to ``clip`` times the median of the peers' recent difference norms;
        ``0`` merges unclipped.
    attack, attackers, attack_scale
        ``attackers`` compromised nodes (the highest ids) send poisoned models of
        this kind (:mod:`fedddl.gossip.attack`; ``attack_scale`` ``None`` = the
        kind's default) and train honestly otherwise. Accuracies are then the
        honest nodes' mean.
    """

    scheduler: str = "scheduled"
    network: str = "homogeneous"
    nodes: int = 16
    dataset: str = "digits"
    data_root: str | None = None
    partition: str = "stratified"
    arch: str | None = None
    target_accuracy: float = 0.9
    max_virtual_time_s: float = 60.0
    seed: int = 0
    lr: float = 0.1
    batch_size: int = 32
    compute_time_s: float | None = 0.05
    compute_heterogeneity: float = 0.0
    eval_interval_s: float = 1.0
    eval_samples: int = 1000
    exchange_every: int = 1
    overlap: bool | None = None
    stale_threshold_steps: float = 10.0
    merge_weight: float = 0.5
    estimator_alpha: float = 0.3
    stop_at_target: bool = False
    selection: str = "proportional"
    compressor: str = ""
    consensus_step: float = 0.25
    scale_bucket: int = 0
    downlink_holds_latency: bool = True
    clip: float = DEFAULT_CLIP
    attack: str = ""
    attackers: int = 0
    attack_scale: float | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.scheduler in ("scheduled", "random"), "scheduler must be scheduled or random"),
            (self.nodes >= 2, "nodes must be >= 2"),
            (0.0 < self.target_accuracy <= 1.0, "target_accuracy must be in (0, 1]"),
            (self.max_virtual_time_s > 0, "max_virtual_time_s must be > 0"),
            (self.lr > 0, "lr must be > 0"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (
                self.compute_time_s is None or self.compute_time_s > 0,
                "compute_time_s must be > 0 (or None to measure)",
            ),
            (self.compute_heterogeneity >= 0, "compute_heterogeneity must be >= 0"),
            (self.eval_interval_s > 0, "eval_interval_s must be > 0"),
            (self.eval_samples >= 0, "eval_samples must be >= 0"),
            (self.exchange_every >= 1, "exchange_every must be >= 1"),
            (self.stale_threshold_steps >= 0, "stale_threshold_steps must be >= 0"),
            (0.0 <= self.merge_weight <= 1.0, "merge_weight must be in [0, 1]"),
            (0.0 < self.consensus_step <= 1.0, "consensus_step must be in (0, 1]"),
            (self.scale_bucket >= -1, "scale_bucket must be 0, N > 0 or -1"),
            (0.0 < self.estimator_alpha <= 1.0, "estimator_alpha must be in (0, 1]"),
            (self.seed >= 0, "seed must be >= 0"),
            (
                self.selection in ("fastest", "proportional"),
                "selection must be fastest or proportional",
            ),
            (self.clip >= 0 and self.clip != float("inf"), "clip must be >= 0 and finite"),
            (not self.attack or self.attack in GOSSIP_ATTACKS,
             f"attack must be one of {sorted(GOSSIP_ATTACKS)}"),
            (0 <= self.attackers < self.nodes, "attackers must be in [0, nodes)"),
            (bool(self.attack) == (self.attackers > 0),
             "attack and attackers >= 1 go together"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid gossip config: {message}")
        if self.compressor:
            from fedddl.compression import available_compressors

            if self.compressor not in available_compressors():
                raise ValueError(
                    f"invalid gossip config: unknown compressor {self.compressor!r}; "
                    f"registered: {', '.join(available_compressors())}"
                )

    @property
    def overlaps(self) -> bool:
        """Whether nodes keep computing while sending."""
        return self.scheduler == "scheduled" if self.overlap is None else self.overlap

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> GossipConfig:
        """Build from a mapping; unknown keys raise ``ValueError`` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown gossip config keys: {unknown}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of all fields."""
        return dataclasses.asdict(self)
