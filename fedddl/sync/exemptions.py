"""TernGrad's fp32 exemptions: which gradients travel uncompressed, and when.

TernGrad's reference code keeps small tensors (``--size_to_binarize``) and the logits
layer (``--noquantize_logits``) in float and can start with fp32 epochs
(``--floating_grad_epoch``); PyTorch's PowerSGD hook has ``start_powerSGD_iter`` for the
same reason. Here, in both directions (client gradients and the server's broadcast):

* ``fp32-min-numel``: parameters with fewer elements travel in fp32;
* ``fp32-logits``: the parameters of the model's last :class:`torch.nn.Linear` (in module
  registration order: the classifier of every built-in model) travel in fp32;
* ``fp32-warmup-rounds``: the first rounds use the fp32 ``identity`` compressor for
  everything.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

from torch import nn

__all__ = ["WARMUP_COMPRESSOR", "exempt_parameters", "logits_parameters"]

#: Exempt names by model (a client asks for its replica's every round; walking the module
#: tree for the logits layer costs more than the rest of its work). A model's trainable
#: parameters are fixed once it is a replica: the names are computed once per setting.
_exempt_cache: WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], frozenset[str]]] = (
    WeakKeyDictionary()
)

#: The compressor of the warm-up rounds.
WARMUP_COMPRESSOR = "identity"


def logits_parameters(model: nn.Module) -> list[str]:
    """Names of the trainable parameters of the model's last ``nn.Linear`` (empty: none)."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    if last is None:
        return []
    prefix = f"{last}." if last else ""
    return [
        prefix + name for name, p in model.get_submodule(last).named_parameters() if p.requires_grad
    ]


def exempt_parameters(model: nn.Module, *, min_numel: int, logits: bool) -> frozenset[str]:
    """Names of the trainable parameters that travel in fp32.

    Computed once per model and setting and remembered while the model lives (a replica's
    trainable parameters do not change).

    Raises
    ------
    ValueError
        If ``min_numel`` is negative.
    """
    if min_numel < 0:
        raise ValueError(f"fp32-min-numel must be >= 0, got {min_numel}")
    known = _exempt_cache.setdefault(model, {})
    key = (min_numel, logits)
    if key not in known:
        names = {
            n for n, p in model.named_parameters() if p.requires_grad and p.numel() < min_numel
        }
        if logits:
            names.update(logits_parameters(model))
        known[key] = frozenset(names)
    return known[key]
