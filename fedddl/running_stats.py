"""BatchNorm running statistics kept identical on every replica.

A TernGrad replica changes only through broadcast updates, so its BatchNorm buffers
(``running_mean``, ``running_var``, ``num_batches_tracked``) must move the same way on
every replica (why not FedBN-style local statistics: docs/training.md):

1. While a client computes its gradient, :class:`BatchStatsRecorder` records, for every
   BatchNorm layer, the per-channel mean and (biased) variance of the layer's inputs over
   all its local minibatches, and the number of values per channel. The client's own
   buffers are not changed.
2. The client sends them in fp32 next to its gradient (:func:`encode_statistics`).
3. The server pools the round's accepted clients with equal weights
   (:class:`StatisticsPool`: mean of the means; mean of ``var + mean²`` minus the pooled
   mean², i.e. the variance of the union of equally weighted clients; the server's
   aggregators pool robustly, with coordinate-wise medians, ``robust=True``) and
   broadcasts one statistics update with the gradient.
4. Every replica, the server's shadow included, applies it exactly as a BatchNorm layer
   in training mode would apply one batch (:func:`apply_statistics`):
   ``running_mean ← (1 − m)·running_mean + m·mean``, ``running_var ← (1 − m)·running_var +
   m·var·n/(n − 1)``, ``num_batches_tracked += 1`` (``m`` the layer's momentum, or
   ``1/num_batches_tracked`` for a cumulative average). The same float operations on the
   same values give bit-identical buffers, so fingerprints still agree.

Equal weights bound what one client's claimed count can do: it only enters the
``n/(n − 1)`` correction.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "BatchStatsRecorder",
    "StatisticsError",
    "StatisticsPool",
    "apply_statistics",
    "batchnorm_layers",
    "check_statistics",
    "record_batch_statistics",
]

MEAN, VAR, COUNT = "mean", "var", "count"


class StatisticsError(ValueError):
    """Statistics do not fit a model (names, shapes, values)."""


def batchnorm_layers(model: nn.Module) -> dict[str, _BatchNorm]:
    """The model's BatchNorm layers that track running statistics, by module name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, _BatchNorm) and module.track_running_stats
    }


def _key(layer: str, part: str) -> str:
    return f"{layer}.{part}"


class BatchStatsRecorder:
    """Accumulate per-channel input statistics of BatchNorm layers over forward passes.

    Use :func:`record_batch_statistics` (a context manager) rather than this class directly.
    Statistics of several batches are merged exactly (Chan et al.'s parallel variance).
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = batchnorm_layers(model)
        self._count: dict[str, float] = {}
        self._mean: dict[str, torch.Tensor] = {}
        self._m2: dict[str, torch.Tensor] = {}
        self._handles = [
            module.register_forward_pre_hook(self._hook(name))
            for name, module in self.layers.items()
        ]

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if not module.training:
                return
            with torch.no_grad():
                x = inputs[0].detach()
                if x.dtype not in (torch.float32, torch.float64):  # half precision
                    x = x.float()
                dims = [d for d in range(x.dim()) if d != 1]
                count = float(x.numel() // x.shape[1])
                # Mean in the activations' precision, squared deviations summed in float64
                # (cheaper than a float64 copy or var_mean; docs/training.md).
                mean = x.mean(dim=dims)
                centred = x - mean.view(1, -1, *([1] * (x.dim() - 2)))
                m2 = (centred * centred).sum(dim=dims, dtype=torch.float64)
                self._merge(name, count, mean.to(torch.float64), m2)

        return hook

    def _merge(self, name: str, count: float, mean: torch.Tensor, m2: torch.Tensor) -> None:
        if name not in self._count:
            self._count[name], self._mean[name], self._m2[name] = count, mean, m2
            return
        n_a, mean_a, m2_a = self._count[name], self._mean[name], self._m2[name]
        total = n_a + count
        delta = mean - mean_a
        self._mean[name] = mean_a + delta * (count / total)
        self._m2[name] = m2_a + m2 + delta**2 * (n_a * count / total)
        self._count[name] = total

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def result(self) -> dict[str, torch.Tensor]:
        """``{"<layer>.mean", "<layer>.var" (biased), "<layer>.count"}`` in float32, on the CPU.

        Empty when the model has no BatchNorm layer or no training-mode forward ran.
        """
        out: dict[str, torch.Tensor] = {}
        for name in self.layers:
            if name not in self._count:
                continue
            count = self._count[name]
            out[_key(name, MEAN)] = self._mean[name].to(torch.float32).cpu()
            out[_key(name, VAR)] = (self._m2[name] / count).to(torch.float32).cpu()
            out[_key(name, COUNT)] = torch.tensor([count], dtype=torch.float32)
        return out


@contextmanager
def record_batch_statistics(model: nn.Module) -> Iterator[BatchStatsRecorder]:
    """Record BatchNorm input statistics of every training-mode forward inside the block."""
    recorder = BatchStatsRecorder(model)
    try:
        yield recorder
    finally:
        recorder.close()


def check_statistics(
    model: nn.Module,
    stats: Mapping[str, torch.Tensor],
    *,
    layers: Mapping[str, _BatchNorm] | None = None,
) -> None:
    """Check that ``stats`` holds finite mean, non-negative var and a count >= 1 per layer.

    ``layers`` is ``batchnorm_layers(model)`` when the caller keeps it (a replica does).

    Raises
    ------
    StatisticsError
        Naming the missing or unexpected entry, a shape mismatch or a bad value.
    """
    layers = batchnorm_layers(model) if layers is None else layers
    want = {_key(n, p) for n in layers for p in (MEAN, VAR, COUNT)}
    missing, extra = sorted(want - set(stats)), sorted(set(stats) - want)
    if missing or extra:
        raise StatisticsError(
            f"statistics do not match the model: missing {missing}, unexpected {extra}"
        )
    for name, module in layers.items():
        channels = int(module.num_features)
        mean, var, count = (stats[_key(name, p)] for p in (MEAN, VAR, COUNT))
        if tuple(mean.shape) != (channels,) or tuple(var.shape) != (channels,):
            raise StatisticsError(f"statistics of {name!r} must have {channels} channels")
        if tuple(count.shape) != (1,):
            raise StatisticsError(f"statistics count of {name!r} must be one value")
        for part, value in ((MEAN, mean), (VAR, var), (COUNT, count)):
            if not value.is_floating_point():
                raise StatisticsError(f"statistics {part} of {name!r} must be finite floats")
    if _values_fine(stats, layers):
        return
    for name in layers:  # name the first bad layer
        mean, var, count = (stats[_key(name, p)] for p in (MEAN, VAR, COUNT))
        for part, value in ((MEAN, mean), (VAR, var), (COUNT, count)):
            if not bool(torch.isfinite(value).all()):
                raise StatisticsError(f"statistics {part} of {name!r} must be finite floats")
        if bool((var < 0).any()) or float(count) < 1:
            raise StatisticsError(f"statistics of {name!r}: var must be >= 0 and count >= 1")


def _values_fine(stats: Mapping[str, torch.Tensor], layers: Mapping[str, _BatchNorm]) -> bool:
    """Every value finite, every var >= 0, every count >= 1: a few fused reductions."""
    if not layers:
        return True
    try:
        by_part = {  # 1-D tensors (shapes checked); cat promotes mixed float dtypes
            part: torch.cat([stats[_key(n, part)].detach() for n in layers])
            for part in (MEAN, VAR, COUNT)
        }
    except RuntimeError:  # e.g. tensors on several devices: the caller checks one by one
        return False
    finite = all(bool(torch.isfinite(values).all()) for values in by_part.values())
    return finite and bool((by_part[VAR] >= 0).all()) and bool((by_part[COUNT] >= 1).all())


class StatisticsPool:
    """Pool the statistics of a round's clients with equal weights (see the module docstring).

    Parameters
    ----------
    robust : bool
        Pool coordinate-wise medians instead of means: per channel, ``mean`` = the median of
        the clients' means and ``var`` = the median of ``var_i + (mean_i − mean)²`` (the
        median of two middle values is their mean). Fewer than half the clients cannot move
        either beyond the honest clients' range, whatever they send.
    """

    def __init__(self, robust: bool = False) -> None:
        self.clients = 0
        self.robust = robust
        self._mean: dict[str, torch.Tensor] = {}
        self._second: dict[str, torch.Tensor] = {}
        self._count: dict[str, float] = {}
        self._means: dict[str, list[torch.Tensor]] = {}
        self._vars: dict[str, list[torch.Tensor]] = {}

    def add(self, stats: Mapping[str, torch.Tensor]) -> None:
        """Add one client's (checked) statistics."""
        for key, value in stats.items():
            layer, _, part = key.rpartition(".")
            if part == COUNT:
                self._count[layer] = self._count.get(layer, 0.0) + float(value)
            elif part == MEAN:
                v = value.to(torch.float64)
                var = stats[_key(layer, VAR)].to(torch.float64)
                if self.robust:
                    self._means.setdefault(layer, []).append(v)
                    self._vars.setdefault(layer, []).append(var)
                    continue
                self._mean[layer] = self._mean.get(layer, 0 * v) + v
                self._second[layer] = self._second.get(layer, 0 * v) + var + v * v
        self.clients += 1

    def result(self) -> dict[str, torch.Tensor]:
        """The pooled ``mean``, biased ``var`` and total ``count`` per layer (float32)."""
        out: dict[str, torch.Tensor] = {}
        if not self.clients:
            return out
        for layer, means in self._means.items():
            mean = _median(torch.stack(means))
            spread = torch.stack(self._vars[layer]) + (torch.stack(means) - mean) ** 2
            out[_key(layer, MEAN)] = mean.to(torch.float32)
            out[_key(layer, VAR)] = _median(spread).clamp_min(0.0).to(torch.float32)
            out[_key(layer, COUNT)] = torch.tensor([self._count[layer]], dtype=torch.float32)
        for layer, total in self._mean.items():
            mean = total / self.clients
            var = (self._second[layer] / self.clients - mean * mean).clamp_min(0.0)
            out[_key(layer, MEAN)] = mean.to(torch.float32)
            out[_key(layer, VAR)] = var.to(torch.float32)
            out[_key(layer, COUNT)] = torch.tensor([self._count[layer]], dtype=torch.float32)
        return out


def _median(values: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median over dim 0 (the mean of the two middle values when even)."""
    ordered = values.sort(dim=0).values
    n = ordered.shape[0]
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def apply_statistics(
    model: nn.Module,
    stats: Mapping[str, torch.Tensor],
    *,
    layers: Mapping[str, _BatchNorm] | None = None,
    checked: bool = False,
) -> None:
    """Move every BatchNorm layer's buffers by one batch with ``stats`` (checked first,
    unless the caller has just checked them: ``checked``).

    ``layers`` is ``batchnorm_layers(model)`` when the caller keeps it.

    Raises
    ------
    StatisticsError
        If ``stats`` does not fit the model (nothing is changed then).
    """
    layers = batchnorm_layers(model) if layers is None else layers
    if not checked:
        check_statistics(model, stats, layers=layers)
    with torch.no_grad():
        for name, module in layers.items():
            assert module.running_mean is not None and module.running_var is not None
            tracked = module.num_batches_tracked
            if tracked is not None:
                tracked.add_(1)
            if module.momentum is None:  # cumulative moving average, as BatchNorm does
                factor = 1.0 / float(tracked) if tracked is not None else 0.0
            else:
                factor = float(module.momentum)
            mean = stats[_key(name, MEAN)]
            var = stats[_key(name, VAR)]
            n = float(stats[_key(name, COUNT)])
            unbiased = var * (n / (n - 1)) if n > 1 else var
            device = module.running_mean.device
            module.running_mean.mul_(1 - factor).add_(mean.to(device), alpha=factor)
            module.running_var.mul_(1 - factor).add_(unbiased.to(device), alpha=factor)
