"""Versioned model replicas shared by the server's shadow copy and every client.

A :class:`Replica` is a model plus its SGD optimiser (with momentum) and a
version: the number of broadcast updates applied to the seeded initial model
(version 0). Every replica that applies the same sequence of decoded updates
with the same optimiser holds bit-identical parameters, which
:meth:`Replica.fingerprint` makes checkable.

A replica that fell behind catches up either by *replaying* the missed updates
from a bounded :class:`UpdateLog`, or by loading a *snapshot* (weights and
momentum buffers) of a replica that is ahead; :func:`plan_catch_up` chooses.
Replaying and loading a snapshot give the identical fingerprint. A replica
that claims a version *ahead* of the current one (possible after the server
resumed from a checkpoint older than its crash) always gets a snapshot: updates
cannot be undone.

Choosing ``update-log-size`` (memory against downlink bytes): ``docs/terngrad.md``.

This module is torch-only (no Flower): records conversion lives in
:mod:`fedddl.flower.records`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fedddl.lr_decay import NO_DECAY, StepDecay
from fedddl.running_stats import (
    StatisticsError,
    apply_statistics,
    batchnorm_layers,
    check_statistics,
)
from fedddl.training import check_parameter_tensors, check_tensors_like

__all__ = [
    "CatchUp",
    "Replica",
    "ReplicaError",
    "UpdateLog",
    "check_update",
    "plan_catch_up",
]

MODEL_PREFIX = "model/"
MOMENTUM_PREFIX = "momentum/"


class ReplicaError(ValueError):
    """An update or snapshot does not fit a replica (names, shapes, values, versions)."""


def check_update(model: nn.Module, update: Mapping[str, torch.Tensor]) -> None:
    """Check that ``update`` holds one finite float tensor per trainable parameter of ``model``.

    Raises
    ------
    ReplicaError
        Naming the missing / unexpected parameter, a shape mismatch or non-finite values.
    """
    check_parameter_tensors(model, update, what="update", finite=True, error=ReplicaError)


class Replica:
    """A model, its momentum SGD optimiser and the number of updates applied.

    Parameters
    ----------
    model : torch.nn.Module
        The model (typically ``create_model(dataset, seed=seed)``); owned by the replica.
    learning_rate : float
        SGD learning rate.
    momentum : float
        SGD momentum (0 disables the buffers).
    version : int
        Number of updates already applied to ``model`` (0 for the seeded initial model).
    lr_decay : StepDecay
        Step decay of ``learning_rate`` by the version an update produces (the round that
        made it); the optimiser's stored rate stays ``learning_rate``.
    """

    def __init__(
        self,
        model: nn.Module,
        learning_rate: float,
        momentum: float,
        version: int = 0,
        *,
        lr_decay: StepDecay = NO_DECAY,
    ) -> None:
        if version < 0:
            raise ReplicaError(f"replica version must be >= 0, got {version}")
        self.model = model
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.version = version
        self.lr_decay = lr_decay
        self._params: OrderedDict[str, nn.Parameter] = OrderedDict(
            (n, p) for n, p in model.named_parameters() if p.requires_grad
        )
        self.optimizer = torch.optim.SGD(
            list(self._params.values()), lr=learning_rate, momentum=momentum, foreach=False
        )
        #: The model's BatchNorm layers that track running statistics (its structure is
        #: fixed: the replica owns the model).
        self.batchnorm = batchnorm_layers(model)

    # ------------------------------------------------------------------ updates
    def check_update(self, update: Mapping[str, torch.Tensor]) -> None:
        """:func:`check_update` against this replica's model (without walking its modules).

        Raises
        ------
        ReplicaError
            Naming the missing / unexpected parameter, a shape mismatch or non-finite values.
        """
        check_tensors_like(self._params, update, what="update", finite=True, error=ReplicaError)

    def apply_update(
        self,
        update: Mapping[str, torch.Tensor],
        version: int,
        statistics: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Apply one decoded broadcast update with the shared optimiser.

        Parameters
        ----------
        update : Mapping[str, torch.Tensor]
            Parameter name to aggregated (pseudo-)gradient.
        version : int
            The version this update produces; must be ``self.version + 1``.
        statistics : Mapping[str, torch.Tensor] | None
            The round's pooled BatchNorm statistics (:mod:`fedddl.running_stats`); required
            exactly when the model has BatchNorm layers.

        Raises
        ------
        ReplicaError
            On a version gap, or an update or statistics that do not fit the model (the
            replica is unchanged then).
        """
        if version != self.version + 1:
            raise ReplicaError(
                f"update produces version {version} but the replica is at {self.version}"
            )
        self.check_update(update)
        if statistics or self.batchnorm:
            try:
                check_statistics(self.model, statistics or {}, layers=self.batchnorm)
            except StatisticsError as err:
                raise ReplicaError(f"update statistics: {err}") from err
        rate = self.lr_decay.rate(self.learning_rate, version)
        if self._plain_sgd():
            self._sgd_step(update, rate)
        else:
            for name, param in self._params.items():
                grad = update[name].detach().to(device=param.device, dtype=param.dtype)
                param.grad = grad.clone()
            for group in self.optimizer.param_groups:
                group["lr"] = rate
            try:
                self.optimizer.step()
            finally:  # the stored rate stays the base rate (checkpoints, snapshots)
                for group in self.optimizer.param_groups:
                    group["lr"] = self.learning_rate
            self.optimizer.zero_grad(set_to_none=True)
        if statistics:
            apply_statistics(self.model, statistics, layers=self.batchnorm, checked=True)
        self.version = version

    def _plain_sgd(self) -> bool:
        """Whether the optimiser is plain momentum SGD (as built here; a restored checkpoint
        could say otherwise), so that :meth:`_sgd_step` is its step."""
        return all(
            group["momentum"] == self.momentum
            and group["dampening"] == 0
            and group["weight_decay"] == 0
            and not group["nesterov"]
            and not group["maximize"]
            for group in self.optimizer.param_groups
        )

    def _sgd_step(self, update: Mapping[str, torch.Tensor], rate: float) -> None:
        """``torch.optim.SGD``'s step (``foreach=False``) at ``rate`` with ``update`` as the
        gradients, op for op, so bit for bit the same, without the optimiser's per-step
        machinery (about half of a small model's update). The momentum buffers stay in
        ``self.optimizer.state`` (snapshots and checkpoints read them there)."""
        momentum = self.momentum
        with torch.no_grad():
            for name, param in self._params.items():
                grad = update[name].detach().to(device=param.device, dtype=param.dtype)
                if momentum != 0:
                    state = self.optimizer.state[param]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = grad.clone()
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1.0)
                    grad = buf
                param.add_(grad, alpha=-rate)

    def fingerprint(self) -> str:
        """Return the sha256 fingerprint of parameters and buffers (see ``fedddl.training``)."""
        from fedddl.training import parameters_fingerprint

        return parameters_fingerprint(self.model)

    # ---------------------------------------------------------------- snapshots
    def snapshot(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Return the state dict and the momentum buffers (copies unless ``copy=False``).

        Keys are ``"model/<name>"`` for every state-dict entry and
        ``"momentum/<name>"`` for every parameter that has a momentum buffer. With
        ``copy=False`` the tensors alias the live replica: serialize them at once.
        """

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone() if copy else t.detach()

        out: dict[str, torch.Tensor] = {
            MODEL_PREFIX + k: take(v) for k, v in self.model.state_dict().items()
        }
        for name, param in self._params.items():
            buf = self.optimizer.state.get(param, {}).get("momentum_buffer")
            if buf is not None:
                out[MOMENTUM_PREFIX + name] = take(buf)
        return out

    def load_snapshot(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace weights and momentum buffers by a :meth:`snapshot` taken at ``version``.

        Raises
        ------
        ReplicaError
            If entries are missing, unexpected or of the wrong shape (state unchanged).
        """
        if version < 0:
            raise ReplicaError(f"snapshot version must be >= 0, got {version}")
        state = self.model.state_dict()
        model_part = {
            k[len(MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)
        }
        mom_part = {
            k[len(MOMENTUM_PREFIX) :]: v
            for k, v in tensors.items()
            if k.startswith(MOMENTUM_PREFIX)
        }
        other = sorted(k for k in tensors if not k.startswith((MODEL_PREFIX, MOMENTUM_PREFIX)))
        missing = sorted(set(state) - set(model_part))
        unexpected = sorted(set(model_part) - set(state)) + sorted(
            set(mom_part) - set(self._params)
        )
        if other or missing or unexpected:
            raise ReplicaError(
                f"snapshot does not match the model: missing {missing}, "
                f"unexpected {unexpected + other}"
            )
        for k, v in model_part.items():
            if tuple(v.shape) != tuple(state[k].shape):
                raise ReplicaError(
                    f"snapshot entry {k!r} has shape {tuple(v.shape)}, model has "
                    f"{tuple(state[k].shape)}"
                )
        for k, v in mom_part.items():
            if tuple(v.shape) != tuple(self._params[k].shape):
                raise ReplicaError(f"snapshot momentum {k!r} has shape {tuple(v.shape)}")
        self.model.load_state_dict(model_part, strict=True)
        self.optimizer.state.clear()
        for k, v in mom_part.items():
            param = self._params[k]
            buffer = v.detach().to(device=param.device, dtype=param.dtype).clone()
            self.optimizer.state[param] = {"momentum_buffer": buffer}
        self.version = version


@dataclass
class UpdateLog:
    """Bounded log of encoded broadcast updates, keyed by the version they produce.

    Parameters
    ----------
    capacity : int
        Number of most recent updates kept (0 keeps none: catch-up is by snapshot only).
    """

    capacity: int

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"update log capacity must be >= 0, got {self.capacity}")
        self._entries: OrderedDict[int, bytes] = OrderedDict()

    def append(self, version: int, payload: bytes) -> None:
        """Record the encoded update that produces ``version`` (must extend the log)."""
        if self._entries and version != next(reversed(self._entries)) + 1:
            raise ValueError(
                f"update log holds up to version {next(reversed(self._entries))}, "
                f"cannot append {version}"
            )
        if self.capacity == 0:
            return
        self._entries[version] = payload
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def oldest(self) -> int | None:
        """Version produced by the oldest kept update, or None when empty."""
        return next(iter(self._entries)) if self._entries else None

    def clear(self) -> None:
        """Forget every kept update (the next one appended may start anywhere)."""
        self._entries.clear()

    def since(self, version: int) -> list[tuple[int, bytes]]:
        """Return the kept updates producing versions ``> version``, oldest first."""
        return [(v, p) for v, p in self._entries.items() if v > version]

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class CatchUp:
    """How to bring a replica at some version to the current one.

    Attributes
    ----------
    kind : str
        ``"none"`` (up to date), ``"log"`` (replay ``updates``) or ``"snapshot"``.
    updates : list[tuple[int, bytes]]
        ``(version, encoded update)`` to replay, oldest first (kind ``"log"``).
    """

    kind: str
    updates: list[tuple[int, bytes]]


def plan_catch_up(replica_version: int, current_version: int, log: UpdateLog) -> CatchUp:
    """Decide how a replica at ``replica_version`` reaches ``current_version``.

    ``replica_version`` is -1 for a replica with no state (it needs a snapshot), and
    a replica that claims to be ahead of the server also gets one.

    Returns
    -------
    CatchUp
        ``none`` when equal, ``log`` when every missed update is kept, else ``snapshot``.
    """
    if replica_version == current_version:
        return CatchUp("none", [])
    if 0 <= replica_version < current_version:
        oldest = log.oldest()
        if oldest is not None and oldest <= replica_version + 1:
            updates = log.since(replica_version)
            if len(updates) == current_version - replica_version:
                return CatchUp("log", updates)
    return CatchUp("snapshot", [])
