"""What of a :class:`~fedddl.sync.server.ReplicaServer` a checkpoint holds, and loading it back.

:func:`capture` takes the shadow replica, its optimiser, the version, the update log and the
downlink state (server-side error-feedback residuals, shared scales), plus any further
server state (the scale bound's history). :func:`load` checks a checkpoint against the
server and builds the state to continue from *on copies*, so a checkpoint that does not fit
changes nothing. Before anything is used it is validated: every weight, momentum buffer,
residual and shared scale finite and shaped like the model's parameter, every parameter
within :data:`PLAUSIBLE_GROWTH` times the server's current one (its initial model on a
resume), every logged update decodable and fitting the model.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedddl.checkpoint import CheckpointError, ServerCheckpoint
from fedddl.compression import PayloadError, ResidualMemory, limits_for
from fedddl.compression.codecs.downlink import decode_broadcast
from fedddl.replica import Replica, ReplicaError, UpdateLog
from fedddl.sync.scale_bound import ScaleBound

__all__ = [
    "PLAUSIBLE_GROWTH",
    "Restored",
    "capture",
    "check_finite",
    "check_like_params",
    "check_plausible",
    "load",
    "load_scale_bound",
]

#: A checkpoint's parameter may be at most this many times larger (largest magnitude)
#: than the same parameter of the server's current model, floored at 1: training moves
#: weights far less, so a larger one is a crafted file (e.g. every weight x1000).
PLAUSIBLE_GROWTH = 100.0


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
    extra: Mapping[str, Any] | None = None,
) -> ServerCheckpoint:
    """The checkpoint of a server after global round ``server_round`` (``owner``: its class;
    ``extra``: further plain-typed state kept in ``strategy_state``)."""
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
            **(extra or {}),
        },
    )


def load(
    ckpt: ServerCheckpoint,
    shadow: Replica,
    log_capacity: int,
    owner: str,
    param_names: Sequence[str] | None = None,
) -> Restored:
    """Check ``ckpt`` against the server's ``shadow`` replica and build the state to continue.

    ``param_names``: the trainable parameters in order (the shared scales' order); default:
    the shadow model's.

    Raises
    ------
    CheckpointError
        If the checkpoint was made by another class, or does not fit the model, the
        optimiser settings or its own version, or holds a non-finite, implausibly large
        (:data:`PLAUSIBLE_GROWTH`) or misshapen value or an update that does not decode or
        fit the model.
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
    params = {n: p for n, p in shadow.model.named_parameters() if p.requires_grad}
    names = list(param_names) if param_names is not None else list(params)
    check_finite(ckpt.model_state, "model weight")
    check_plausible(ckpt.model_state, params)
    check_like_params(memory, params, "server_memory residual")
    if scales is not None and (
        tuple(scales.shape) != (len(names),)
        or not bool(torch.isfinite(scales).all())
        or bool((scales < 0).any())
    ):
        raise CheckpointError(
            f"checkpoint shared_scales must be {len(names)} finite non-negative values, "
            f"got shape {tuple(scales.shape)}"
        )
    limits = limits_for(shadow.model.state_dict())
    for version, payload in entries:
        try:
            shadow.check_update(decode_broadcast(payload, **limits))
        except (PayloadError, ReplicaError) as err:
            raise CheckpointError(f"checkpoint update log: version {version}: {err}") from err
    log = UpdateLog(log_capacity)
    for version, payload in entries:
        log.append(version, payload)
    return Restored(
        shadow=_shadow(ckpt, shadow),
        log=log,
        memory=ResidualMemory({str(k): v for k, v in memory.items()}),
        shared_scales=None if scales is None else scales.clone(),
    )


def load_scale_bound(ckpt: ServerCheckpoint, bound: ScaleBound) -> ScaleBound:
    """``bound`` (a fresh scale bound) with the history ``ckpt`` saved, if any.

    Raises
    ------
    CheckpointError
        If the saved state is malformed.
    """
    saved = ckpt.strategy_state.get("scale_bound")
    if saved is not None:
        if not isinstance(saved, dict):
            raise CheckpointError("checkpoint scale_bound state must be a dict")
        try:
            bound.load_state(saved)
        except ValueError as err:
            raise CheckpointError(f"checkpoint scale_bound state: {err}") from err
    return bound


def check_finite(tensors: Mapping[str, Any], what: str) -> None:
    """Raise ``CheckpointError`` unless every value is a tensor, and floating ones finite."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"checkpoint {what} {name!r} is not a tensor")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"checkpoint {what} {name!r} has non-finite values")


def check_plausible(
    weights: Mapping[str, torch.Tensor], params: Mapping[str, torch.nn.Parameter]
) -> None:
    """Each saved parameter's largest magnitude within :data:`PLAUSIBLE_GROWTH` times the
    current parameter's (at least 1)."""
    for name, param in params.items():
        saved = weights.get(name)
        if not isinstance(saved, torch.Tensor) or not saved.is_floating_point():
            continue  # a missing or misshapen tensor is refused when the model is restored
        if not saved.numel() or not param.numel():
            continue
        limit = PLAUSIBLE_GROWTH * max(float(param.detach().abs().max()), 1.0)
        peak = float(saved.abs().max())
        if peak > limit:
            raise CheckpointError(
                f"checkpoint model weight {name!r} reaches {peak:.4g}, more than "
                f"{PLAUSIBLE_GROWTH:g} x this model's (limit {limit:.4g}): not a trained model"
            )


def check_like_params(
    tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.nn.Parameter], what: str
) -> None:
    """Each tensor named after a parameter, of its shape, floating and finite."""
    for name, value in tensors.items():
        param = params.get(str(name))
        if param is None:
            raise CheckpointError(f"checkpoint {what} {name!r} is not a model parameter")
        if not value.is_floating_point() or tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(
                f"checkpoint {what} {name!r} is {value.dtype} {tuple(value.shape)}, the "
                f"parameter is {tuple(param.shape)}"
            )
    check_finite(tensors, what)


def _shadow(ckpt: ServerCheckpoint, current: Replica) -> Replica:
    """A new shadow replica loaded from ``ckpt`` (``current`` is left unchanged)."""
    lr, momentum = current.learning_rate, current.momentum
    shadow = Replica(
        copy.deepcopy(current.model), lr, momentum, version=0, lr_decay=current.lr_decay
    )
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
    buffers: dict[str, torch.Tensor] = {}
    params = {n: p for n, p in shadow.model.named_parameters() if p.requires_grad}
    by_param = {id(p): n for n, p in params.items()}
    for param, state in shadow.optimizer.state.items():
        name = by_param.get(id(param), "?")
        for key, value in state.items():
            if key == "momentum_buffer" and value is None:
                continue
            if key != "momentum_buffer" or not isinstance(value, torch.Tensor):
                raise CheckpointError(f"checkpoint optimizer state of {name!r} has {key!r}")
            buffers[name] = value
    check_like_params(buffers, params, "momentum buffer")
    shadow.version = ckpt.version
    return shadow
