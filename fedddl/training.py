"""Training helpers shared by Flower clients and gossip nodes.

Gradients, evaluation, an exact parameter fingerprint and an endless reproducible
minibatch stream over in-memory tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.nn import functional

__all__ = [
    "check_parameter_tensors",
    "check_tensors_like",
    "compute_gradients",
    "evaluate",
    "gradients_of",
    "iterate_minibatches",
    "local_sgd",
    "model_device",
    "named_gradients",
    "parameters_fingerprint",
    "set_gradients",
    "tensors_fingerprint",
]


def _check_batch(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.shape[0] == 0:
        raise ValueError("empty batch: x has no rows")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(
            f"y must be 1-D with {x.shape[0]} labels (one per row of x), got shape {tuple(y.shape)}"
        )


def compute_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Zero the gradients, run forward and backward of the mean cross-entropy loss; return it.

    ``x`` are inputs ``N×C×H×W``, ``y`` int64 labels ``N``; the batch is moved to the
    model's device. The model's current mode (train/eval) is used as is; the gradients are
    left in ``.grad``.
    """
    _check_batch(x, y)
    device = model_device(model)
    model.zero_grad(set_to_none=False)
    loss = functional.cross_entropy(model(x.to(device)), y.to(device))
    loss.backward()  # type: ignore[no-untyped-call]
    return float(loss.detach())


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for an empty model."""
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def named_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return copies of all trainable parameters' gradients (zeros where ``.grad`` is None)."""
    return gradients_of(_trainable(model).items())


def gradients_of(params: Iterable[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    """:func:`named_gradients` of ``(name, parameter)`` pairs the caller already holds (no
    walk of the module tree)."""
    return {
        name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for name, p in params
    }


def check_parameter_tensors(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    what: str = "gradient",
    finite: bool = False,
    error: type[Exception] = ValueError,
) -> None:
    """Check that ``tensors`` holds one floating tensor per trainable parameter of ``model``.

    Raises ``error`` (default ``ValueError``) naming the missing or unexpected names, a shape
    mismatch, a non-float dtype or (with ``finite``) NaN/Inf values; ``what`` names the
    tensors in the message (``"gradient"``, ``"update"``, ...).
    """
    check_tensors_like(_trainable(model), tensors, what=what, finite=finite, error=error)


def check_tensors_like(
    params: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    *,
    what: str = "gradient",
    finite: bool = False,
    error: type[Exception] = ValueError,
) -> None:
    """:func:`check_parameter_tensors` against an explicit name → parameter mapping.

    For callers that keep their model's trainable parameters (a replica checks every
    update it applies and need not walk the module tree each time).
    """
    missing = sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params))
    if missing or unknown:
        raise error(f"{what} names do not match the model: missing {missing}, unexpected {unknown}")
    for name, param in params.items():
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise error(f"{what} {name!r} must be a floating-point tensor")
        if tuple(tensor.shape) != tuple(param.shape):
            raise error(
                f"{what} {name!r} has shape {tuple(tensor.shape)}, "
                f"parameter has {tuple(param.shape)}"
            )
    if finite and not _all_finite([tensors[name] for name in params]):
        for name in params:
            if not bool(torch.isfinite(tensors[name]).all()):
                raise error(f"{what} {name!r} has non-finite values")


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every value is finite; one fused reduction over all tensors.

    The 1-norms are sums of absolute values: a NaN or an infinity makes one non-finite. A
    float32 sum can also overflow on finite values above ~1e38 in total, so False only
    means "check tensor by tensor" (the caller does, to name the tensor).
    """
    if not tensors:
        return True
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for group in by_device.values():
        norms = torch._foreach_norm(group, 1)
        if not bool(torch.isfinite(torch.stack(norms)).all()):
            return False
    return True


def set_gradients(model: nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Write ``grads`` into the ``.grad`` of the model's trainable parameters.

    Everything is checked first (:func:`check_parameter_tensors`): a ``ValueError`` for a
    missing or unknown name, a shape mismatch or a non-float gradient leaves the model
    untouched.
    """
    check_parameter_tensors(model, grads)
    for name, p in _trainable(model).items():
        p.grad = grads[name].detach().to(device=p.device, dtype=p.dtype).clone()


def local_sgd(
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    optimizer: torch.optim.Optimizer | None,
    on_gradient: Callable[[], None] | None = None,
) -> tuple[float, int]:
    """Run ``steps`` minibatch steps on ``model``: gradient, ``on_gradient()``, optimiser step.

    The one local training loop of fedddl: stock FedAvg clients pass their momentum SGD
    optimiser; the localized-replica clients pass plain SGD on a copy (or ``None`` for a
    single gradient) and collect the gradients in ``on_gradient``.

    Returns
    -------
    tuple[float, int]
        The mean loss over the steps and the number of examples used.

    Raises
    ------
    ValueError
        If ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    losses: list[float] = []
    examples = 0
    for _ in range(steps):
        xb, yb = next(batches)
        losses.append(compute_gradients(model, xb, yb))
        examples += int(xb.shape[0])
        if on_gradient is not None:
            on_gradient()
        if optimizer is not None:
            optimizer.step()
    return sum(losses) / len(losses), examples


def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float]:
    """Return ``(mean cross-entropy loss, accuracy)`` over ``x, y``, in eval mode, no grad.

    Batches are moved to the model's device.

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
    device = model_device(model)
    model.eval()
    total_loss = 0.0
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], batch_size):
                logits = model(x[start : start + batch_size].to(device))
                labels = y[start : start + batch_size].to(device)
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
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors_fingerprint(tensors)


def tensors_fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 hex digest of named tensors (names, dtypes, shapes, raw bytes), in sorted
    name order: equal exactly when every name and value is bit-identical."""
    digest = hashlib.sha256()
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
