"""Client side of the localized-replica protocol (TernGrad / GradientAverage) in Flower.

Per message: parse the instruction (:mod:`fedddl.flower.protocol`), restore the client's
state from ``context.state`` (:mod:`clients.state`), follow the instruction with the
Flower-free :func:`fedddl.sync.worker.run_instruction` (catch up, compute, encode), save
the state and reply. With ``downlink = "grid"`` the state is the grid snapshot of
:mod:`clients.grid_state`.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context, Message

from clients.grid_state import load_grid_state, save_grid_state
from clients.shard import load_shard, partition_of
from clients.state import load_state, save_state
from fedddl.app_config import AppConfig
from fedddl.devices import resolve_device
from fedddl.flower.protocol import build_reply_content, parse_train_content
from fedddl.sync.messages import ClientReply
from fedddl.sync.worker import WorkerState, run_instruction

__all__ = ["compute_reply", "handle_localized_train"]


def handle_localized_train(message: Message, context: Context, cfg: AppConfig) -> Message:
    """Handle one TernGrad/GradientAverage training message (see the module docstring)."""
    reply = compute_reply(message, context, cfg)
    return Message(content=build_reply_content(reply), reply_to=message)


def compute_reply(message: Message, context: Context, cfg: AppConfig) -> ClientReply:
    """Follow one training message and return the (Flower-free) reply; saves the state."""
    instruction = parse_train_content(message.content)
    pid, num = partition_of(context.node_config)
    model_fn = cfg.model_factory(device=resolve_device(cfg.device))
    key = context.run_id  # the run's clients in this process share one live replica
    where = cfg.client_snapshot_dir
    snapshot_dir = None if where in ("auto", "state") else Path(where)
    state: WorkerState
    if cfg.resolved_downlink == "grid":
        state = load_grid_state(context.state, model_fn)
    else:
        state = load_state(
            context.state,
            model_fn,
            cfg.learning_rate,
            cfg.momentum,
            key=key,
            lr_decay=cfg.lr_decay(),
            updates=None if instruction.snapshot is not None else dict(instruction.updates),
            target=instruction.model_version,
            snapshot_dir=snapshot_dir,
        )
    reply = run_instruction(
        state,
        instruction,
        node_id=int(context.node_id),
        partition_id=pid,
        shard=lambda: load_shard(cfg, pid, num),
        model_fn=model_fn,
        cfg=cfg,
    )
    if cfg.resolved_downlink == "grid":
        save_grid_state(context.state, state)
    else:
        save_state(context.state, state, key=key, snapshot_dir=snapshot_dir)
    return reply
