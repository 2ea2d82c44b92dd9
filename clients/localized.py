"""Client side of the localized-replica protocol (TernGrad / GradientAverage).

Per message: restore the replica from ``context.state`` (or build it from the
shared seed, or load the server's snapshot), apply the missed broadcast updates
in version order with the shared optimiser, compute the (pseudo-)gradient of
``local-steps`` minibatches on the shard, encode it and reply with payload,
fingerprint and version. A client that cannot reach the requested version
replies ``resync`` with the version it holds (-1: none), and the server sends a
log catch-up or a snapshot next time.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import lru_cache

import torch
from flwr.app import Context, Message, RecordDict
from torch import nn

from clients.shard import load_shard, partition_of
from clients.state import ClientState, load_state, save_state
from fedddl.app_config import AppConfig
from fedddl.compression import PayloadError, decode_update, encode_update
from fedddl.replica import Replica, ReplicaError
from strategies.downlink import decode_broadcast
from strategies.strategy_utils import (
    TrainInstruction,
    build_reply_content,
    build_resync_content,
    derive_seed,
    make_compressor,
    parse_train_content,
)

__all__ = ["compute_pseudo_gradient", "handle_localized_train", "model_factory"]


@lru_cache(maxsize=8)
def _seeded_model(dataset: str, seed: int, arch: str) -> nn.Module:
    from fedddl.models import create_model

    return create_model(dataset, seed=seed, arch=arch or None)


def model_factory(cfg: AppConfig) -> Callable[[], nn.Module]:
    """Return the seeded model constructor shared by the server and every client.

    ``create_model`` is deterministic in the seed, so the model is built once per
    process and each call returns a deep copy (cheaper than re-initialising).
    """

    def build() -> nn.Module:
        return copy.deepcopy(_seeded_model(cfg.dataset, cfg.seed, cfg.arch))

    return build


def compute_pseudo_gradient(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int,
    local_steps: int,
    learning_rate: float,
    seed: int,
) -> tuple[dict[str, torch.Tensor], float, int]:
    """Return ``(pseudo-gradient, mean loss, examples used)``; ``model`` is left unchanged.

    One step: the minibatch gradient at the replica. ``K`` steps: plain SGD on a copy,
    and the sum of the K gradients along the way, i.e. ``(w_0 - w_K) / lr``.
    """
    from fedddl.training import compute_gradients, iterate_minibatches, named_gradients

    generator = torch.Generator().manual_seed(seed)
    batches = iterate_minibatches(x, y, min(batch_size, x.shape[0]), generator)
    work = model if local_steps == 1 else copy.deepcopy(model)
    buffers = {k: b.detach().clone() for k, b in work.named_buffers()}
    params = [p for p in work.parameters() if p.requires_grad]
    total: dict[str, torch.Tensor] | None = None
    losses: list[float] = []
    examples = 0
    for _ in range(local_steps):
        xb, yb = next(batches)
        losses.append(compute_gradients(work, xb, yb))
        examples += int(xb.shape[0])
        grads = named_gradients(work)
        total = grads if total is None else {k: total[k] + grads[k] for k in total}
        if local_steps > 1:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-learning_rate)
    work.zero_grad(set_to_none=True)
    if work is model:  # the replica's buffers (e.g. BatchNorm) change only via updates
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    assert total is not None
    return total, sum(losses) / len(losses), examples


def _reach_version(
    st: ClientState, instr: TrainInstruction, model_fn: Callable[[], nn.Module], cfg: AppConfig
) -> Replica | None:
    """Bring the client's replica to ``instr.model_version``; None if that is impossible."""
    if instr.snapshot is not None:
        fresh = Replica(model_fn(), cfg.learning_rate, cfg.momentum, version=0)
        fresh.load_snapshot(instr.snapshot, instr.snapshot_version)
        st.replica = fresh
    elif st.replica is None:
        first = instr.updates[0][0] if instr.updates else instr.model_version + 1
        if first != 1:
            return None
        st.replica = Replica(model_fn(), cfg.learning_rate, cfg.momentum, version=0)
    replica = st.replica
    for version, payload in instr.updates:
        if version <= replica.version:
            continue
        if version != replica.version + 1:
            break
        try:
            replica.apply_update(decode_broadcast(payload), version)
        except (PayloadError, ReplicaError):
            break
    return replica if replica.version == instr.model_version else None


def handle_localized_train(message: Message, context: Context, cfg: AppConfig) -> Message:
    """Handle one TernGrad/GradientAverage training message (see module docstring)."""
    instr = parse_train_content(message.content)
    pid, num = partition_of(context.node_config)
    model_fn = model_factory(cfg)
    st = load_state(context.state, model_fn, cfg.learning_rate, cfg.momentum)
    if instr.compressor is not None:
        st.compressor = instr.compressor
    replica = _reach_version(st, instr, model_fn, cfg)
    if replica is None or st.compressor is None:
        save_state(context.state, st)
        version = -1 if st.replica is None or st.compressor is None else st.replica.version
        return Message(content=build_resync_content(version), reply_to=message)

    x, y = load_shard(cfg, pid, num)
    grads, loss, examples = compute_pseudo_gradient(
        replica.model,
        x,
        y,
        batch_size=cfg.batch_size,
        local_steps=cfg.local_steps,
        learning_rate=cfg.learning_rate,
        seed=derive_seed(cfg.seed, pid, instr.server_round, 3),
    )
    compressor = make_compressor(
        st.compressor,
        clip_sigma=cfg.clip_sigma,
        seed=derive_seed(cfg.seed, pid, instr.server_round, 5),
    )
    compensated = {
        k: g + st.residuals[k] if cfg.error_feedback and k in st.residuals else g
        for k, g in grads.items()
    }
    local_scales = None
    if instr.want_scales:
        local_scales = torch.tensor(
            [compressor.local_scale(t) or 0.0 for t in compensated.values()], dtype=torch.float32
        )
    scales: dict[str, float] | None = None
    if instr.scales is not None and instr.scales.numel() == len(compensated):
        scales = {}
        for (k, t), s in zip(list(compensated.items()), instr.scales.tolist(), strict=True):
            if s > 0:
                compensated[k] = t.clamp(-s, s)
                scales[k] = s
    payload = encode_update(compensated, compressor, None, scales=scales)
    if cfg.error_feedback:
        sent = decode_update(payload)
        st.residuals = {k: compensated[k] - sent[k] for k in compensated}
    save_state(context.state, st)
    content: RecordDict = build_reply_content(
        payload,
        fingerprint=replica.fingerprint(),
        model_version=replica.version,
        num_examples=examples,
        loss=loss,
        scales=local_scales,
    )
    return Message(content=content, reply_to=message)
