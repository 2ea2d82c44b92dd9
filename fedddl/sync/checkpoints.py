"""What of a :class:`~fedddl.sync.server.ReplicaServer` a checkpoint holds, and loading it back.

:func:`capture` takes the shadow replica, its optimiser, the version, the update log and the
downlink state (server-side error-feedback residuals, shared scales). :func:`load` checks a
checkpoint against the server and builds the state to continue from *on copies*, so a
checkpoint that does not fit changes nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fedddl.checkpoint import CheckpointError, ServerCheckpoint
from fedddl.compression import ResidualMemory
from fedddl.replica import Replica, UpdateLog

__all__ = ["Restored", "capture", "load"]


@dataclass(frozen=True)
class Restored:
    """The server state a checkpoint describes, ready to replace the current one."""

    shadow: Replica
    log: UpdateLog
    memory: ResidualMemory
    shared_scales: torch.Tensor | None


def capture(
    shadow: Replica,
    log: UpdateLog,
    memory: ResidualMemory,
    shared_scales: torch.Tensor | None,
    *,
    server_round: int,
    config: dict[str, object],
    owner: str,
) -> ServerCheckpoint:
    """The checkpoint of a server after global round ``server_round`` (``owner``: its class)."""
    return ServerCheckpoint(
        round=server_round,
        version=shadow.version,
        model_state={k: v.detach().clone() for k, v in shadow.model.state_dict().items()},
        optimizer_state=shadow.optimizer.state_dict(),
        update_log=log.since(-1),
        config=dict(config),
        rng_states={"torch": torch.get_rng_state()},
        strategy_state={
            "server_memory": memory.residuals,
            "shared_scales": shared_scales,
            "strategy_class": owner,
        },
    )


def load(ckpt: ServerCheckpoint, shadow: Replica, log_capacity: int, owner: str) -> Restored:
    """Check ``ckpt`` against the server's ``shadow`` replica and build the state to continue.

    Raises
    ------
    CheckpointError
        If the checkpoint was made by another class, or does not fit the model, the
        optimiser settings or its own version.
    """
    saved_class = ckpt.strategy_state.get("strategy_class")
    if saved_class is not None and saved_class != owner:
        raise CheckpointError(f"checkpoint was made by {saved_class}, this run uses {owner}")
    memory = ckpt.strategy_state.get("server_memory", {})
    scales = ckpt.strategy_state.get("shared_scales")
    if not isinstance(memory, dict) or not all(
        isinstance(t, torch.Tensor) for t in memory.values()
    ):
        raise CheckpointError("checkpoint server_memory must map names to tensors")
    if scales is not None and not isinstance(scales, torch.Tensor):
        raise CheckpointError("checkpoint shared_scales must be a tensor or None")
    entries = list(ckpt.update_log)
    if entries and entries[-1][0] != ckpt.version:
        raise CheckpointError(
            f"checkpoint update log ends at version {entries[-1][0]}, "
            f"not at the checkpoint version {ckpt.version}"
        )
    log = UpdateLog(log_capacity)
    for version, payload in entries:
        log.append(version, payload)
    return Restored(
        shadow=_shadow(ckpt, shadow),
        log=log,
        memory=ResidualMemory({str(k): v for k, v in memory.items()}),
        shared_scales=None if scales is None else scales.clone(),
    )


def _shadow(ckpt: ServerCheckpoint, current: Replica) -> Replica:
    """A new shadow replica loaded from ``ckpt`` (``current`` is left unchanged)."""
    lr, momentum = current.learning_rate, current.momentum
    shadow = Replica(copy.deepcopy(current.model), lr, momentum, version=0)
    ckpt.restore_model(shadow.model)
    try:
        shadow.optimizer.load_state_dict(ckpt.optimizer_state)
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint optimizer state does not fit: {err}") from err
    for group in shadow.optimizer.param_groups:
        if group["lr"] != lr or group["momentum"] != momentum:
            raise CheckpointError(
                f"checkpoint optimizer has lr={group['lr']} momentum={group['momentum']}, "
                f"this run lr={lr} momentum={momentum}"
            )
    shadow.version = ckpt.version
    return shadow
