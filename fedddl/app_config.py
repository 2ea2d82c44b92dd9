"""Typed run configuration of the fedddl Flower app.

One :class:`AppConfig` describes a whole run (strategy, data, optimiser,
compression). It is built from Flower's ``run_config`` (the
``[tool.flwr.app.config]`` table of ``pyproject.toml``, kebab-case keys) by
:meth:`AppConfig.from_run_config`, or directly in Python (the in-process
``fedddl simulate`` path, where Flower's ``run_simulation`` gives an empty
``run_config``). Unknown keys and badly typed values raise ``ValueError`` naming
the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from fedddl.app_config_checks import check_run_sizes
from fedddl.bn_momentum_choice import AUTO as AUTO_BN
from fedddl.bn_momentum_choice import parse_bn_momentum, resolve_bn_momentum
from fedddl.defenses import Defenses
from fedddl.devices import check_device_name
from fedddl.downlink_choice import AUTO, resolve_downlink
from fedddl.lr_decay import StepDecay
from fedddl.run_config_keys import coerce, kebab, unknown_key_message
from fedddl.scale_bucket_choice import AUTO as AUTO_BUCKET
from fedddl.scale_bucket_choice import parse_scale_bucket, resolve_scale_bucket

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DOWNLINKS", "PARTITIONS", "AppConfig"]

_DEFENSES = Defenses()  # the defence keys' defaults are the server's

# Keys of the gossip mode share the Flower run config but not this dataclass.
GOSSIP_KEY_PREFIX = "gossip-"

PARTITIONS: tuple[str, ...] = ("stratified", "random", "dirichlet")
DOWNLINKS: tuple[str, ...] = (AUTO, "reternarize", "shared-scale-sum", "grid")
BUILTIN_STRATEGIES: tuple[str, ...] = ("terngrad", "gradient-average", "fedavg")


@dataclass(frozen=True)
class AppConfig:
    """Configuration of one federated run.

    Attributes
    ----------
    num_server_rounds : int
        Number of rounds (one aggregated update each).
    strategy : str
        ``"terngrad"``, ``"gradient-average"``, ``"fedavg"`` or ``"module:Class"``.
    dataset : str
        Dataset name (see :data:`fedddl.data.DATASETS`).
    data_root : str
        Data directory; empty means the default.
    arch : str
        Model architecture (``mlp``, ``cnn``, ``resnet8``, ``resnet20``, ``resnet18``); empty
        means the dataset's default.
    model : str
        Your own model, ``"package.module:factory"`` with ``factory(input_shape,
        num_classes) -> nn.Module`` (see :func:`fedddl.models.load_model_factory`); replaces
        ``arch``. ``dataset`` takes your own data the same way
        (:func:`fedddl.data.load_dataset`).
    device : str
        Where models, replicas, shards and compression live: ``cpu``, ``cuda``, ``cuda:N``
        or ``auto`` (CUDA when present).
    partition : str
        Shard method: ``"stratified"``, ``"random"`` or ``"dirichlet"``.
    dirichlet_alpha : float
        Concentration of the Dirichlet partition.
    seed : int
        Shared seed of the model initialisation, shards and sampling.
    learning_rate, momentum : float
        SGD parameters of the shared optimiser (applied identically by every replica).
    lr_milestones, lr_gamma : str, float
        Step decay of the learning rate: ``"200,300"`` multiplies it by ``lr_gamma`` after
        round 200 and again after round 300 (:mod:`fedddl.lr_decay`); empty: constant.
    bn_momentum : float or str
        Momentum of every BatchNorm layer of the model, in (0, 1]: how far each round's pooled
        statistics move the running ones (:mod:`fedddl.running_stats`); 0 keeps the model's
        own (torch's 0.1 in the built-in models); ``"auto"`` (default): 0.5 at
        ``fraction-train`` < 1, else 0 (:mod:`fedddl.bn_momentum_choice`, the choice made is
        :attr:`resolved_bn_momentum`). It changes the running statistics (what evaluation
        uses), never the weights.
    batch_size : int
        Minibatch size of each client per local step.
    local_steps : int
        Local steps per round. With K > 1 a client runs K plain-SGD steps from its replica
        and sends the mean of the K gradients along that path, ``(w_0 - w_K) / (K·lr)``
        ("local gradient averaging"); the server applies momentum SGD to the average of
        those, as to a single gradient (:mod:`fedddl.sync.worker`).
    fraction_train : float
        Fraction of clients sampled per round, in (0, 1].
    compressor : str
        Registered uplink compressor name (TernGrad); GradientAverage forces ``identity``.
    downlink : str
        ``"auto"`` (default: ``"grid"`` for TernGrad at ``fraction-train`` < 1, else
        ``"reternarize"``; :mod:`fedddl.downlink_choice`, the choice made is
        :attr:`resolved_downlink`), ``"reternarize"``, ``"shared-scale-sum"`` or ``"grid"``:
        the server applies momentum
        itself and keeps every replica's trainable parameters on an integer grid; a sampled
        client gets one count-delta message however far behind it is
        (:mod:`fedddl.sync.grid_shadow`). In grid mode ``fp32-min-numel`` and
        ``fp32-logits`` apply to the uplink only (every parameter is on the grid), the
        downlink log is ``grid-log-size`` rounds (not ``update-log-size``).
    grid_levels : int
        Grid downlink: the codes of a round lie in ``[-grid-levels, grid-levels]`` (1:
        ternary), 1 to 127.
    grid_log_size : int
        Grid downlink: rounds of updates the server keeps for catch-ups (further behind
        gets a grid snapshot).
    clip_sigma : float
        Ternary gradient clipping, in standard deviations.
    error_feedback : bool
        Keep a residual memory on each client for the uplink.
    fp32_min_numel : int
        Parameters with fewer elements travel in fp32 both ways (:mod:`fedddl.sync.exemptions`).
    fp32_logits : bool
        The last ``nn.Linear``'s parameters travel in fp32 both ways.
    fp32_warmup_rounds : int
        The first rounds send everything in fp32 (the ``identity`` compressor).
    scale_bucket : int or str
        Scales of the ternary codes, both ways: ``"auto"`` (default: -1 where the downlink
        and compressor carry buckets, else 0; :mod:`fedddl.scale_bucket_choice`, the choice
        made is :attr:`resolved_scale_bucket`); 0 one per tensor (TernGrad's layer-wise
        scaler); ``N > 0`` one per bucket of ``N`` consecutive values; -1 one per output
        channel (:mod:`fedddl.compression.algorithms.ternary_buckets`; a tensor of one
        dimension keeps one scale). A non-zero value is refused with the
        ``shared-scale-sum`` downlink or ``ternary-entropy``.
    update_log_size : int
        Encoded broadcast updates the server keeps for catch-up; further behind gets a snapshot.
    client_snapshot_dir : str
        Where a TernGrad-family client keeps the snapshot of its replica: ``"state"``, in
        ``context.state``; a directory, in files there shared by the processes of one machine
        (an absolute path; ``context.state`` names the file; :mod:`clients.snapshot_files`);
        ``"auto"``: a temporary directory per run in :func:`fedddl.flower.simulation.run`
        (``fedddl simulate``: Flower ships ``context.state`` to the actor and back with every
        message), ``"state"`` elsewhere (``flwr run``, deployments).
    min_available_nodes : int
        Nodes the server waits for before the first round.
    min_replies : int
        Valid replies a TernGrad-family round needs to apply an update; with fewer the
        round is logged and skipped (no update, every replica keeps its version).
    eval_every : int
        The ServerApp evaluates the shared model every ``eval_every`` rounds (and after the
        last); rounds in between record no accuracy.
    eval_samples : int
        Evaluate on the first ``eval_samples`` test examples (0: the whole test split).
    results_path : str
        When not empty, the ServerApp writes the run's JSON there.
    plugins : str
        Comma-separated modules imported by the ServerApp and every ClientApp before
        the run (e.g. to register a custom compressor by name).
    checkpoint_dir : str
        Directory of the ServerApp's checkpoints; empty disables checkpointing and
        resuming. When it holds a checkpoint, the run resumes from the newest readable one.
    checkpoint_every : int
        Save a checkpoint after every ``checkpoint_every``-th (global) round; 0 never saves.
    checkpoint_keep : int
        Newest checkpoints kept in ``checkpoint_dir`` (older ones are deleted).
    checkpoint_allow_fresh_start : bool
        When ``checkpoint_dir`` holds checkpoint files but none is readable, start from
        round 0 (overwriting them) instead of stopping with an error; with a key, also
        resume after a rollback (from the newest readable checkpoint, logged at WARNING
        with the rounds) instead of stopping.
    checkpoint_key_file : str
        File holding a secret key (at least 16 bytes): checkpoints are then written with an
        HMAC-SHA256 tag and only checkpoints with a valid tag are loaded; a high-water mark
        in ``checkpoint_dir`` refuses a rollback to an older round.
    aggregator : str
        How a TernGrad-family server combines the accepted gradients: ``"mean"``,
        ``"median"``, ``"trimmed-mean"`` or ``"sign-vote"`` (:mod:`fedddl.sync.robust`).
    trim_fraction : float
        Share of the values cut from each end by ``"trimmed-mean"``, in ``[0, 0.5)``.
    scale_bound : float
        Bound ``k`` on the ternary scales: a reply's scale above ``k ×`` the median scale of
        the round (and recent rounds) is clipped or dropped; also caps the shared scales of
        ``shared-scale-sum``; 0 disables it (:mod:`fedddl.sync.scale_bound`).
    scale_bound_action : str
        ``"clip"`` or ``"drop"`` a reply above the bound.
    scale_bound_rounds : int
        Previous rounds whose accepted scales join the bound's median.
    scale_weight : float
        A reply's scale above this multiple of the median is clipped to it (0: no cap
        below the bound).
    direction_check : float
        A TernGrad-family server drops a reply whose signs agree with the other replies'
        majority vote less than this fraction of the round's median agreement, in
        ``[0, 1]``, and one with more than twice the round's median count of non-zero
        values; 0: both off (:mod:`fedddl.sync.direction`).
    statistics_bound : float
        A reply's BatchNorm statistics are clipped to within this many standard deviations
        of the server shadow's running statistics (means; variances to within its square
        as a factor), from the second round on; 0 disables it
        (:mod:`fedddl.sync.statistics_shadow`).
    norm_clip : float
        Per tensor, a reply whose L2 norm is above this multiple of the lower median of the
        round's norms of that tensor is scaled down to it (after the direction check);
        0 disables it (:mod:`fedddl.sync.norm_clip`).
    resync_interval : int
        Resyncs (snapshots, multi-update catch-ups) a node causes are served at most once
        every this many rounds, twice as long each time while it keeps failing; 0 or 1: no
        limit (:mod:`fedddl.sync.resync_limit`).
    attack : str
        Attack evaluation only: ``KIND[:ARG]`` run by ``num_attackers`` clients
        (:mod:`fedddl.attacks.spec`); empty: none.
    num_attackers : int
        Clients (partition ids chosen from ``seed``) that run ``attack``.
    """

    num_server_rounds: int = 100
    strategy: str = "terngrad"
    dataset: str = "digits"
    data_root: str = ""
    arch: str = ""
    model: str = ""
    device: str = "cpu"
    partition: str = "stratified"
    dirichlet_alpha: float = 0.5
    seed: int = 0
    learning_rate: float = 0.1
    momentum: float = 0.9
    lr_milestones: str = ""
    lr_gamma: float = 0.1
    bn_momentum: float | str = AUTO_BN
    batch_size: int = 32
    local_steps: int = 1
    fraction_train: float = 1.0
    compressor: str = "ternary-base3"
    downlink: str = AUTO
    clip_sigma: float = 2.5
    error_feedback: bool = False
    fp32_min_numel: int = 0
    fp32_logits: bool = True
    fp32_warmup_rounds: int = 0
    scale_bucket: int | str = AUTO_BUCKET
    update_log_size: int = 8
    grid_levels: int = 1
    grid_log_size: int = 256
    client_snapshot_dir: str = "auto"
    min_available_nodes: int = 2
    min_replies: int = 1
    eval_every: int = 1
    eval_samples: int = 0
    results_path: str = ""
    plugins: str = ""
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    checkpoint_allow_fresh_start: bool = False
    checkpoint_key_file: str = ""
    aggregator: str = _DEFENSES.aggregator
    trim_fraction: float = _DEFENSES.trim_fraction
    scale_bound: float = _DEFENSES.scale_bound
    scale_bound_action: str = _DEFENSES.scale_bound_action
    scale_bound_rounds: int = _DEFENSES.scale_bound_rounds
    scale_weight: float = _DEFENSES.scale_weight
    resync_interval: int = _DEFENSES.resync_interval
    direction_check: float = _DEFENSES.direction_check
    statistics_bound: float = _DEFENSES.statistics_bound
    norm_clip: float = _DEFENSES.norm_clip
    attack: str = ""
    num_attackers: int = 0

    def __post_init__(self) -> None:
        """Validate every field; raise ``ValueError`` naming the bad key."""
        if self.num_server_rounds < 1:
            raise ValueError(f"num-server-rounds must be >= 1, got {self.num_server_rounds}")
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"partition must be one of {', '.join(PARTITIONS)}, got {self.partition!r}"
            )
        if self.downlink not in DOWNLINKS:
            raise ValueError(
                f"downlink must be one of {', '.join(DOWNLINKS)}, got {self.downlink!r}"
            )
        if self.strategy not in BUILTIN_STRATEGIES and ":" not in self.strategy:
            raise ValueError(
                f"strategy must be one of {', '.join(BUILTIN_STRATEGIES)} or 'module:Class', "
                f"got {self.strategy!r}"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"learning-rate must be > 0, got {self.learning_rate}")
        self.lr_decay()  # validates lr-milestones and lr-gamma
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        object.__setattr__(self, "bn_momentum", parse_bn_momentum(self.bn_momentum))
        check_run_sizes(self)
        object.__setattr__(self, "scale_bucket", parse_scale_bucket(self.scale_bucket))
        self._check_scale_bucket()
        if self.eval_every < 1:
            raise ValueError(f"eval-every must be >= 1, got {self.eval_every}")
        if self.eval_samples < 0:
            raise ValueError(f"eval-samples must be >= 0 (0: all), got {self.eval_samples}")
        if self.model and self.arch:
            raise ValueError(f"give model ({self.model!r}) or arch ({self.arch!r}), not both")
        if self.model and ":" not in self.model:
            raise ValueError(f"model must look like 'package.module:factory', got {self.model!r}")
        check_device_name(self.device)
        self.defenses()  # validates aggregator, trim-fraction, scale-bound-*, resync-interval
        from fedddl.attacks.spec import parse_attack

        attack = parse_attack(self.attack)
        if self.num_attackers < 0:
            raise ValueError(f"num-attackers must be >= 0, got {self.num_attackers}")
        if attack is None and self.num_attackers > 0:
            raise ValueError("num-attackers > 0 needs an attack (e.g. attack = 'sign-flip')")
        if attack is not None and self.num_attackers == 0:
            raise ValueError(f"attack {self.attack!r} needs num-attackers >= 1")

    def _check_scale_bucket(self) -> None:
        """Refuse an explicit non-zero ``scale-bucket`` the downlink or a registered
        compressor cannot carry (a plugin's compressor is checked by
        :attr:`resolved_scale_bucket`, once the plugins are imported)."""
        takes = True
        if self.scale_bucket not in (AUTO_BUCKET, 0):
            from fedddl.compression import available_compressors, takes_scale_bucket

            if self.compressor in available_compressors():
                takes = takes_scale_bucket(self.compressor)
        resolve_scale_bucket(
            self.scale_bucket,
            downlink=self.downlink,
            compressor=self.compressor,
            compressor_takes_buckets=takes,
        )

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> AppConfig:
        """Build from a Flower ``run_config`` (kebab-case keys); missing keys keep defaults.

        Raises
        ------
        ValueError
            On an unknown key or a value of the wrong type.
        """
        by_key = {kebab(f.name): f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in run_config.items():
            if key.startswith(GOSSIP_KEY_PREFIX):
                continue  # gossip mode's keys, read by strategies.gossip_coordinator
            f = by_key.get(key)
            if f is None:
                raise ValueError(unknown_key_message(key, by_key))
            parse = _PARSERS.get(key)
            kwargs[f.name] = parse(value) if parse else coerce(key, value, f.default)
        return cls(**kwargs)

    @property
    def resolved_downlink(self) -> str:
        """The downlink this run uses: ``downlink``, with ``"auto"`` resolved
        (:func:`fedddl.downlink_choice.resolve_downlink`)."""
        return resolve_downlink(
            self.downlink, strategy=self.strategy, fraction_train=self.fraction_train
        )

    @property
    def resolved_bn_momentum(self) -> float:
        """The BatchNorm momentum this run sets (0: the model's own): ``bn_momentum``, with
        ``"auto"`` resolved (:func:`fedddl.bn_momentum_choice.resolve_bn_momentum`)."""
        return resolve_bn_momentum(self.bn_momentum, fraction_train=self.fraction_train)

    @property
    def resolved_scale_bucket(self) -> int:
        """The scale buckets of this run's ``compressor``: :meth:`scale_bucket_for` it."""
        return self.scale_bucket_for(self.compressor)

    def scale_bucket_for(self, compressor: str) -> int:
        """The scale buckets ``compressor`` sends with in this run: ``scale_bucket``, with
        ``"auto"`` resolved (:func:`fedddl.scale_bucket_choice.resolve_scale_bucket`; call it
        after :meth:`import_plugins`). A TernGrad server resolves it for the compressor it
        names (``compressor_name()``), its clients for the one they are told to use.

        Raises
        ------
        ValueError
            For an unknown compressor, or a non-zero ``scale_bucket`` with one that takes
            no scale buckets.
        """
        from fedddl.compression import takes_scale_bucket

        return resolve_scale_bucket(
            self.scale_bucket,
            downlink=self.resolved_downlink,
            compressor=compressor,
            compressor_takes_buckets=takes_scale_bucket(compressor),
        )

    def updated(self, run_config: Mapping[str, Any]) -> AppConfig:
        """Return a copy with the kebab-case keys of ``run_config`` applied (any field).

        Keys and values are checked as in :meth:`from_run_config`: ``ValueError`` on an unknown
        key (naming the closest known one) or a bad value.
        """
        return AppConfig.from_run_config({**self.to_run_config(), **run_config})

    def to_run_config(self) -> dict[str, Any]:
        """Return the kebab-case mapping (JSON-friendly) of every field."""
        return {kebab(f.name): getattr(self, f.name) for f in fields(self)}

    def import_plugins(self) -> None:
        """Import every module named in ``plugins``.

        Raises
        ------
        ValueError
            Naming a module that cannot be imported.
        """
        import importlib

        for name in (m.strip() for m in self.plugins.split(",")):
            if not name:
                continue
            try:
                importlib.import_module(name)
            except ImportError as err:
                raise ValueError(f"plugins: cannot import {name!r}: {err}") from err

    def model_factory(self, device: torch.device | str | None = None) -> Callable[[], nn.Module]:
        """The seeded model constructor of this run, the same in the server and every client.

        See :func:`fedddl.models.seeded_model_factory`; every BatchNorm layer gets momentum
        :attr:`resolved_bn_momentum` (unless 0); with ``device`` the models are placed there.
        """
        from fedddl.models import seeded_model_factory, with_bn_momentum

        seeded = seeded_model_factory(self.dataset, seed=self.seed, arch=self.model or self.arch)
        momentum = self.resolved_bn_momentum

        def build() -> nn.Module:
            return with_bn_momentum(seeded(), momentum)

        if device is None:
            return build
        return lambda: build().to(device)

    def lr_decay(self) -> StepDecay:
        """The learning-rate step decay of ``lr-milestones`` / ``lr-gamma``."""
        return StepDecay.parse(self.lr_milestones, self.lr_gamma)

    def defenses(self) -> Defenses:
        """The server's defence settings (:class:`fedddl.defenses.Defenses`).

        Raises
        ------
        ValueError
            Naming a bad setting.
        """
        return Defenses(
            aggregator=self.aggregator,
            trim_fraction=self.trim_fraction,
            scale_bound=self.scale_bound,
            scale_bound_action=self.scale_bound_action,
            scale_bound_rounds=self.scale_bound_rounds,
            scale_weight=self.scale_weight,
            resync_interval=self.resync_interval,
            direction_check=self.direction_check,
            statistics_bound=self.statistics_bound,
            norm_clip=self.norm_clip,
        )

    def replace(self, **changes: Any) -> AppConfig:
        """Return a copy with ``changes`` (snake_case field names) applied."""
        return dataclasses.replace(self, **changes)


#: Keys whose values are not of one type, with their own parser (``ValueError`` if bad).
_PARSERS: dict[str, Callable[[Any], Any]] = {
    "scale-bucket": parse_scale_bucket,
    "bn-momentum": parse_bn_momentum,
}
