"""Error-feedback memories: compensate before compressing, update after."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

__all__ = ["Memory", "NoMemory", "ResidualMemory"]


class Memory(ABC):
    """Per-tensor-name state for error feedback.

    :meth:`compensate` must not change the memory (so a failed encode leaves it
    untouched); only :meth:`update` commits.
    """

    @abstractmethod
    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Return the tensor to compress for ``name`` (e.g. ``tensor + residual``)."""

    @abstractmethod
    def update(self, name: str, tensor: torch.Tensor, decompressed: torch.Tensor) -> None:
        """Record what was sent: ``tensor`` is the compensated input, ``decompressed`` its
        reconstruction."""


class NoMemory(Memory):
    """No error feedback: tensors are compressed as given."""

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Return ``tensor`` unchanged."""
        return tensor

    def update(self, name: str, tensor: torch.Tensor, decompressed: torch.Tensor) -> None:
        """Do nothing."""


class ResidualMemory(Memory):
    """Keeps ``residual[name] = compensated - decompressed`` and adds it back next time.

    Over steps, ``sum(decompressed) + residual == sum(inputs)`` (up to float
    rounding): nothing that compression dropped is lost, only delayed.
    Residuals are kept in the tensor's own dtype; ``residuals`` restores saved ones.
    """

    def __init__(self, residuals: Mapping[str, torch.Tensor] | None = None) -> None:
        self._residuals: dict[str, torch.Tensor] = {
            name: r.detach().clone() for name, r in (residuals or {}).items()
        }

    @property
    def residuals(self) -> dict[str, torch.Tensor]:
        """A copy of the current residuals by name."""
        return {name: r.clone() for name, r in self._residuals.items()}

    def reset(self) -> None:
        """Forget all residuals."""
        self._residuals.clear()

    def save(self) -> dict[str, torch.Tensor]:
        """A cheap snapshot for :meth:`restore` (no copy: residuals are replaced by
        :meth:`update`, never written in place, so the saved tensors stay valid)."""
        return dict(self._residuals)

    def restore(self, saved: Mapping[str, torch.Tensor]) -> None:
        """Go back to a :meth:`save` (e.g. after an update that could not be sent)."""
        self._residuals = dict(saved)

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Return ``tensor + residual[name]`` (a new tensor; the memory is unchanged)."""
        residual = self._residuals.get(name)
        if residual is None:
            return tensor
        if residual.shape != tensor.shape or residual.dtype != tensor.dtype:
            raise ValueError(
                f"tensor {name!r} is {tuple(tensor.shape)}/{tensor.dtype} but its residual is "
                f"{tuple(residual.shape)}/{residual.dtype}"
            )
        return tensor + residual

    def update(self, name: str, tensor: torch.Tensor, decompressed: torch.Tensor) -> None:
        """Set ``residual[name] = tensor - decompressed``."""
        if decompressed.shape != tensor.shape:
            raise ValueError(
                f"tensor {name!r}: decompressed shape {tuple(decompressed.shape)} != "
                f"{tuple(tensor.shape)}"
            )
        target = decompressed.to(device=tensor.device, dtype=tensor.dtype)
        self._residuals[name] = (tensor.detach() - target).detach()
