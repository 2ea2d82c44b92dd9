"""What of a ``grid`` downlink server a checkpoint holds, and loading it back.

The same :class:`~fedddl.checkpoint.ServerCheckpoint` file as the other downlinks, filled
so that a resumed run continues bit for bit:

* ``model_state``: the grid replica's model (for inspection; the snapshot below rules);
* ``update_log``: the :class:`~fedddl.sync.grid_log.GridLog`'s rounds, each as the
  count-delta message (``FDGC``) from the version before it, oldest first;
* ``strategy_state``: ``grid_snapshot`` (the replica's ``FDGS`` snapshot: anchors, units,
  counts, buffers, version), ``grid_velocity`` (the server's momentum),
  ``grid_residuals`` and ``grid_exponents`` (the quantizer's error feedback and last
  exponents), ``grid_rebased``, the uplink ``server_memory``, the owner class and
  ``extra``.

:func:`load` checks everything against the running server's model before anything is
used and builds the state on copies: every message decodes for the model, every tensor is
finite and shaped like its parameter, the weights are plausible
(:data:`~fedddl.sync.checkpoints.PLAUSIBLE_GROWTH`) and the versions line up.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedddl.checkpoint import CheckpointError, ServerCheckpoint
from fedddl.compression import PayloadError, ResidualMemory
from fedddl.compression.codecs.count_delta import MAX_EXPONENT, MIN_EXPONENT, CountDelta
from fedddl.compression.codecs.counts import decode_counts, encode_counts
from fedddl.sync.checkpoints import check_finite, check_like_params, check_plausible
from fedddl.sync.grid import GridError
from fedddl.sync.grid_log import GridLog
from fedddl.sync.grid_quantizer import GridQuantizer
from fedddl.sync.grid_replica import GridReplica

__all__ = ["GridRestored", "capture", "load"]


@dataclass(frozen=True)
class GridRestored:
    """The grid server state a checkpoint describes, ready to replace the current one."""

    replica: GridReplica
    log: GridLog
    velocity: dict[str, torch.Tensor]
    residuals: dict[str, torch.Tensor]
    exponents: dict[str, int]
    rebased: bool
    memory: ResidualMemory


def capture(
    replica: GridReplica,
    log: GridLog,
    quantizer: GridQuantizer,
    velocity: Mapping[str, torch.Tensor],
    *,
    rebased: bool,
    memory: ResidualMemory,
    server_round: int,
    config: dict[str, object],
    owner: str,
    extra: Mapping[str, Any] | None = None,
) -> ServerCheckpoint:
    """The checkpoint of a grid server after global round ``server_round``."""
    layout = replica.layout
    entries = [
        (version, encode_counts(_one_round(log, version), layout))
        for version in range(log.oldest + 1, log.newest + 1)
    ]
    return ServerCheckpoint(
        round=server_round,
        version=replica.version,
        model_state={k: v.detach().clone() for k, v in replica.model.state_dict().items()},
        update_log=entries,
        config=dict(config),
        rng_states={"torch": torch.get_rng_state()},
        strategy_state={
            "server_memory": memory.residuals,
            "shared_scales": None,
            "strategy_class": owner,
            "grid_snapshot": replica.snapshot_bytes(),
            "grid_velocity": {k: v.detach().clone() for k, v in velocity.items()},
            "grid_residuals": {k: v.detach().clone() for k, v in quantizer.residuals.items()},
            "grid_exponents": dict(quantizer.exponents),
            "grid_rebased": bool(rebased),
            **(extra or {}),
        },
    )


def _one_round(log: GridLog, version: int) -> CountDelta:
    delta = log.catch_up(version - 1, version)
    if delta is None:  # one round's codes always fit a delta
        raise ValueError(f"grid log: round {version} does not encode")
    return delta


def load(
    ckpt: ServerCheckpoint, current: GridReplica, log_capacity: int, owner: str
) -> GridRestored:
    """Check ``ckpt`` against the server's ``current`` replica and build the state to continue
    (``current`` is left unchanged).

    Raises
    ------
    CheckpointError
        If the checkpoint was made by another class or without the grid, or any part does
        not decode for the model, is misshapen, not finite, implausibly large, or its
        versions do not line up.
    """
    state = ckpt.strategy_state
    saved_class = state.get("strategy_class")
    if saved_class is not None and saved_class != owner:
        raise CheckpointError(f"checkpoint was made by {saved_class}, this run uses {owner}")
    snapshot = state.get("grid_snapshot")
    if not isinstance(snapshot, bytes):
        raise CheckpointError(
            "checkpoint holds no grid state (made with another downlink?): "
            "the grid downlink cannot resume from it"
        )
    replica = GridReplica(copy.deepcopy(current.model))
    try:
        replica.load_snapshot_bytes(snapshot)
    except GridError as err:
        raise CheckpointError(f"checkpoint grid snapshot: {err}") from err
    if replica.version != ckpt.version:
        raise CheckpointError(
            f"checkpoint grid snapshot is at version {replica.version}, "
            f"the checkpoint at {ckpt.version}"
        )
    params = {n: p for n, p in current.model.named_parameters() if p.requires_grad}
    check_plausible(dict(replica.model.named_parameters()), params)
    check_finite(dict(replica.model.named_buffers()), "grid snapshot buffer")
    velocity = _tensors(state, "grid_velocity", params)
    residuals = _tensors(state, "grid_residuals", params)
    memory = _tensors(state, "server_memory", params)
    exponents = state.get("grid_exponents", {})
    if not isinstance(exponents, dict) or not all(
        str(k) in params and type(e) is int and MIN_EXPONENT <= e <= MAX_EXPONENT
        for k, e in exponents.items()
    ):
        raise CheckpointError(
            f"checkpoint grid_exponents must map parameter names to ints in "
            f"[{MIN_EXPONENT}, {MAX_EXPONENT}]"
        )
    rebased = state.get("grid_rebased")
    if not isinstance(rebased, bool):
        raise CheckpointError("checkpoint grid_rebased must be a bool")
    return GridRestored(
        replica=replica,
        log=_log(ckpt, replica, log_capacity),
        velocity=velocity,
        residuals=residuals,
        exponents={str(k): int(e) for k, e in exponents.items()},
        rebased=rebased,
        memory=ResidualMemory(memory),
    )


def _tensors(
    state: Mapping[str, Any], key: str, params: Mapping[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor]:
    value = state.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(t, torch.Tensor) for t in value.values()):
        raise CheckpointError(f"checkpoint {key} must map names to tensors")
    tensors = {str(k): t.detach().clone() for k, t in value.items()}
    check_like_params(tensors, params, key)
    return tensors


def _log(ckpt: ServerCheckpoint, replica: GridReplica, capacity: int) -> GridLog:
    """The grid log of ``ckpt``'s ``update_log`` (its newest ``capacity`` rounds)."""
    entries = list(ckpt.update_log)[-capacity:]
    if entries and entries[-1][0] != ckpt.version:
        raise CheckpointError(
            f"checkpoint update log ends at version {entries[-1][0]}, "
            f"not at the checkpoint version {ckpt.version}"
        )
    first = entries[0][0] if entries else ckpt.version + 1
    log = GridLog(capacity, version=first - 1)
    for version, payload in entries:
        try:
            delta = decode_counts(payload, replica.layout, replica.max_bytes())
            if (delta.from_version, delta.to_version) != (version - 1, version) or len(
                delta.segments
            ) != 1:
                raise CheckpointError(
                    f"checkpoint update log: version {version} is not one round's update"
                )
            log.append(version, delta.segments[0])
        except (PayloadError, ValueError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(f"checkpoint update log: version {version}: {err}") from err
    return log
