"""The client side of the localized-replica protocol, without Flower.

Per instruction (:func:`run_instruction`): bring the replica to the requested version
(load the server's snapshot, or build the seeded model, then apply the missed broadcast
updates in version order with the shared optimiser, BatchNorm statistics included),
compute the (pseudo-)gradient of ``local-steps`` minibatches on the shard and the
BatchNorm input statistics, encode the gradient with the uplink compressor (error
feedback, scaler sharing and fp32 exemptions through :mod:`fedddl.compression`) and
answer with payload, statistics, fingerprint and version. A client that cannot reach
the requested version answers ``resync`` with the version it holds (-1: none), and the
server sends a log catch-up or a snapshot next time. With ``downlink = "grid"`` the
replica is a :class:`~fedddl.sync.grid_replica.GridReplica` (``WorkerState.grid``, no
client momentum) brought forward by :func:`~fedddl.sync.grid_catch_up.reach_grid_version`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fedddl.app_config import AppConfig
from fedddl.compression import (
    IdentityCompressor,
    ResidualMemory,
    encode_update,
    local_scales,
    make_compressor,
)
from fedddl.replica import Replica
from fedddl.running_stats import record_batch_statistics
from fedddl.seeding import derive_seed
from fedddl.sync.exemptions import exempt_parameters
from fedddl.sync.grid_catch_up import reach_grid_version
from fedddl.sync.grid_replica import GridReplica
from fedddl.sync.journal import replay
from fedddl.sync.messages import ClientReply, TrainInstruction, fingerprint_prefix
from fedddl.training import gradients_of, iterate_minibatches, local_sgd

__all__ = ["WorkerState", "compute_pseudo_gradient", "reach_version", "run_instruction"]


@dataclass
class WorkerState:
    """What a client keeps between rounds (``replica`` is None before the first message).

    Attributes
    ----------
    replica : Replica | None
        The client's replica.
    compressor : str | None
        The uplink compressor name, once the server has told it.
    memory : ResidualMemory
        Error-feedback residuals of the uplink (empty unless ``error-feedback``).
    journal : list[tuple[int, bytes]]
        The encoded broadcast updates applied since ``saved_version``, oldest first: with
        the snapshot saved at that version they rebuild the replica exactly.
    saved_version : int | None
        Version of the last full snapshot written to durable state (None: none that this
        replica descends from, e.g. after loading a server snapshot).
    grid : GridReplica | None
        The client's replica in ``grid`` downlink mode (``replica`` stays None then).
    chains : list[str]
        History digests of the replica at ``saved_version`` and after each journaled update
        (kept by the persistence layer, ``clients.state``; the first ones when the journal
        grew since).
    """

    replica: Replica | None = None
    compressor: str | None = None
    memory: ResidualMemory = field(default_factory=ResidualMemory)
    journal: list[tuple[int, bytes]] = field(default_factory=list)
    saved_version: int | None = None
    chains: list[str] = field(default_factory=list)
    grid: GridReplica | None = field(default=None, kw_only=True)


def compute_pseudo_gradient(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int,
    local_steps: int,
    learning_rate: float,
    seed: int,
) -> tuple[dict[str, torch.Tensor], float, int, dict[str, torch.Tensor]]:
    """Return ``(pseudo-gradient, mean loss, examples used, BatchNorm statistics)``.

    ``model`` is left unchanged, BatchNorm buffers included.

    One step: the minibatch gradient at the replica. ``K`` steps ("local gradient
    averaging"): plain SGD with ``learning_rate`` on a copy, and the mean of the K
    gradients along the way, i.e. ``(w_0 - w_K) / (K·lr)``; the server then applies its
    momentum SGD step to the average of these as to one gradient, so the size of a round's
    step does not grow with K. The statistics are the per-channel input mean and variance
    of every BatchNorm layer over all K minibatches (:mod:`fedddl.running_stats`).
    """
    generator = torch.Generator().manual_seed(seed)
    batches = iterate_minibatches(x, y, min(batch_size, x.shape[0]), generator)
    work = model if local_steps == 1 else copy.deepcopy(model)
    # the parameters are walked once (a walk of the module tree is not free on a small model)
    buffers = {k: b.detach().clone() for k, b in work.named_buffers()}
    params = [(n, p) for n, p in work.named_parameters() if p.requires_grad]
    optimizer = None
    if local_steps > 1:
        trainable = [p for _, p in params]
        optimizer = torch.optim.SGD(trainable, lr=learning_rate, momentum=0.0, foreach=False)
    total: dict[str, torch.Tensor] = {}

    def collect() -> None:
        grads = gradients_of(params)
        total.update(grads if not total else {k: total[k] + grads[k] for k in total})

    with record_batch_statistics(work) as recorder:
        loss, examples = local_sgd(work, batches, local_steps, optimizer, on_gradient=collect)
    for _, p in params:
        p.grad = None
    if work is model:  # the replica's buffers change only through broadcast updates
        with torch.no_grad():
            for k, b in model.named_buffers():  # by name: a module may have replaced one
                b.copy_(buffers[k])
    if local_steps > 1:
        total = {k: g / local_steps for k, g in total.items()}
    return total, loss, examples, recorder.result()


def reach_version(
    state: WorkerState,
    instruction: TrainInstruction,
    model_fn: Callable[[], nn.Module],
    cfg: AppConfig,
) -> Replica | None:
    """Bring ``state.replica`` to ``instruction.model_version``; None if that is impossible."""
    if instruction.snapshot is not None:
        fresh = Replica(
            model_fn(), cfg.learning_rate, cfg.momentum, version=0, lr_decay=cfg.lr_decay()
        )
        fresh.load_snapshot(instruction.snapshot, instruction.snapshot_version)
        state.replica, state.journal, state.saved_version = fresh, [], None
    elif state.replica is None:
        first = instruction.updates[0][0] if instruction.updates else instruction.model_version + 1
        if first != 1:
            return None
        state.replica = Replica(
            model_fn(), cfg.learning_rate, cfg.momentum, version=0, lr_decay=cfg.lr_decay()
        )
        state.journal, state.saved_version = [], None
    replica = state.replica
    state.journal.extend(replay(replica, instruction.updates, out=_device_buffers(replica)))
    return replica if replica.version == instruction.model_version else None


def _device_buffers(replica: Replica) -> dict[str, torch.Tensor] | None:
    """Float32 decode buffers on the replica's device when it is not the CPU (else None).

    Broadcasts then decode on the device: only the packed bytes cross from the host.
    """
    first = next(replica.model.parameters(), None)
    if first is None or first.device.type == "cpu":
        return None
    params = [(n, p) for n, p in replica.model.named_parameters() if p.requires_grad]
    return {n: torch.empty(p.shape, dtype=torch.float32, device=p.device) for n, p in params}


def run_instruction(
    state: WorkerState,
    instruction: TrainInstruction,
    *,
    node_id: int,
    partition_id: int,
    shard: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    model_fn: Callable[[], nn.Module],
    cfg: AppConfig,
) -> ClientReply:
    """Follow one instruction and return the reply (see the module docstring).

    ``state`` is updated in place (replica, compressor, residuals). ``shard`` returns the
    client's ``(x, y)``; it is called only when a gradient is computed. ``model_fn``
    builds the seeded model on the run's device.
    """
    if instruction.compressor is not None:
        state.compressor = instruction.compressor
    replica: Replica | GridReplica | None
    held: Replica | GridReplica | None
    if cfg.resolved_downlink == "grid":
        state.grid = held = reach_grid_version(state.grid, instruction, model_fn)
        replica = held if held is not None and held.version == instruction.model_version else None
    else:
        replica = reach_version(state, instruction, model_fn, cfg)
        held = state.replica
    if replica is None or state.compressor is None:
        version = -1 if held is None or state.compressor is None else held.version
        return ClientReply.resync_request(node_id, version)
    x, y = shard()
    grads, loss, examples, statistics = compute_pseudo_gradient(
        replica.model,
        x,
        y,
        batch_size=cfg.batch_size,
        local_steps=cfg.local_steps,
        learning_rate=cfg.lr_decay().rate(cfg.learning_rate, replica.version + 1),
        seed=derive_seed(cfg.seed, partition_id, instruction.server_round, 3),
    )
    compressor = make_compressor(
        state.compressor,
        seed=derive_seed(cfg.seed, partition_id, instruction.server_round, 5),
        clip_sigma=cfg.clip_sigma,
        scale_bucket=cfg.scale_bucket_for(state.compressor),
    )
    dense = exempt_parameters(replica.model, min_numel=cfg.fp32_min_numel, logits=cfg.fp32_logits)
    memory = state.memory if cfg.error_feedback else None
    mine = None
    if instruction.want_scales:
        ternary = {k: g for k, g in grads.items() if k not in dense}
        found = local_scales(ternary, compressor, memory)
        mine = torch.tensor([found.get(k, 0.0) for k in grads], dtype=torch.float32)
    shared = None
    if instruction.scales is not None and instruction.scales.numel() == len(grads):
        pairs = zip(grads, instruction.scales.tolist(), strict=True)
        shared = {k: s for k, s in pairs if s > 0 and k not in dense}
    payload = encode_update(grads, compressor, memory, scales=shared, clamp=True, dense=dense)
    return ClientReply(
        node_id=node_id,
        model_version=replica.version,
        fingerprint=fingerprint_prefix(replica.fingerprint()).hex(),
        payload=payload,
        num_examples=examples,
        loss=loss,
        scales=mine,
        statistics=encode_update(statistics, IdentityCompressor()) if statistics else None,
        partition_id=partition_id,
    )
