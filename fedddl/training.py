"""Training helpers shared by Flower clients and gossip nodes.

Gradients, evaluation, an exact parameter fingerprint and an endless reproducible
minibatch stream over in-memory tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.nn import functional

__all__ = [
    "compute_gradients",
    "evaluate",
    "iterate_minibatches",
    "named_gradients",
    "parameters_fingerprint",
    "set_gradients",
]


def _check_batch(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.shape[0] == 0:
        raise ValueError("empty batch: x has no rows")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(
            f"y must be 1-D with {x.shape[0]} labels (one per row of x), got shape {tuple(y.shape)}"
        )


def compute_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Zero the gradients, run forward and backward of the mean cross-entropy loss.

    The model's current mode (train/eval) is used as is. Gradients are left in ``.grad``.

    Parameters
    ----------
    model : torch.nn.Module
        Classifier returning logits.
    x : torch.Tensor
        Inputs ``N×C×H×W``.
    y : torch.Tensor
        Int64 labels ``N``.

    Returns
    -------
    float
        The loss value.
    """
    _check_batch(x, y)
    model.zero_grad(set_to_none=False)
    loss = functional.cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach())


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def named_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return copies of all trainable parameters' gradients (zeros where ``.grad`` is None)."""
    return {
        name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for name, p in _trainable(model).items()
    }


def set_gradients(model: nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Write ``grads`` into the ``.grad`` of the model's trainable parameters.

    Every name, shape and dtype is validated before anything is written, so a bad
    mapping leaves the model untouched.

    Raises
    ------
    KeyError
        If names are missing from or unknown to the model.
    ValueError
        If a shape differs or a gradient is not a floating-point tensor.
    """
    params = _trainable(model)
    missing = sorted(set(params) - set(grads))
    unknown = sorted(set(grads) - set(params))
    if missing or unknown:
        raise KeyError(
            f"gradient names do not match the model: missing {missing}, unknown {unknown}"
        )
    for name, p in params.items():
        g = grads[name]
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise ValueError(f"gradient {name!r} must be a floating-point tensor")
        if g.shape != p.shape:
            raise ValueError(
                f"gradient {name!r} has shape {tuple(g.shape)}, parameter has {tuple(p.shape)}"
            )
    for name, p in params.items():
        p.grad = grads[name].detach().to(device=p.device, dtype=p.dtype).clone()


def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float]:
    """Return ``(mean cross-entropy loss, accuracy)`` over ``x, y``, in eval mode, no grad.

    The model's previous train/eval mode is restored afterwards.

    Raises
    ------
    ValueError
        If ``x`` is empty, ``y`` does not match it or ``batch_size`` < 1.
    """
    _check_batch(x, y)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    total_loss = 0.0
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], batch_size):
                logits = model(x[start : start + batch_size])
                labels = y[start : start + batch_size]
                total_loss += float(functional.cross_entropy(logits, labels, reduction="sum"))
                correct += int((logits.argmax(dim=1) == labels).sum())
    finally:
        model.train(was_training)
    return total_loss / x.shape[0], correct / x.shape[0]


def parameters_fingerprint(model: nn.Module) -> str:
    """SHA-256 hex digest of all parameters and buffers (names, dtypes, shapes, raw bytes).

    Tensors are hashed in sorted name order, so two models fingerprint equal exactly when
    every value is bit-identical.
    """
    digest = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        # Reinterpreting as bytes avoids a copy and works for every dtype (bfloat16 too).
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def iterate_minibatches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield an endless stream of shuffled ``(x_batch, y_batch)`` of exactly ``batch_size`` rows.

    Indices come from consecutive random permutations drawn from ``generator`` (each
    epoch visits every sample once; a batch may straddle two epochs), so the stream is
    reproducible from the generator's seed.

    Raises
    ------
    ValueError
        If ``x`` is empty, ``y`` does not match it or ``batch_size`` < 1.
    """
    _check_batch(x, y)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = x.shape[0]
    pending = torch.empty(0, dtype=torch.int64)
    while True:
        while pending.numel() < batch_size:
            pending = torch.cat([pending, torch.randperm(n, generator=generator)])
        batch, pending = pending[:batch_size], pending[batch_size:]
        yield x[batch], y[batch]
