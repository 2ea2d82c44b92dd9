"""A compromised gossip peer: a valid identity that sends poisoned models.

The poison stays within the admission bounds (finite, ``|w| <= max_abs_weight``), so
only the receivers' merge clip (:mod:`fedddl.gossip.clip`) limits it. Kinds:

``constant``
    Every floating-point weight set to ``scale`` (default 999, just under the
    default weight bound of 1000).
``scaled-initial``
    ``scale`` times the shared initial model (default -50).
``sign-flip``
    ``scale`` times the attacker's own trained model (default -1).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["GOSSIP_ATTACKS", "attack_scale", "poison_state"]

#: Attack kinds and their default ``scale``.
GOSSIP_ATTACKS: dict[str, float] = {
    "constant": 999.0,
    "scaled-initial": -50.0,
    "sign-flip": -1.0,
}


def attack_scale(kind: str, scale: float | None) -> float:
    """``scale``, or the kind's default when ``None``.

    Raises
    ------
    ValueError
        On an unknown kind.
    """
    if kind not in GOSSIP_ATTACKS:
        raise ValueError(f"unknown gossip attack {kind!r}; known: {sorted(GOSSIP_ATTACKS)}")
    return GOSSIP_ATTACKS[kind] if scale is None else float(scale)


def poison_state(
    kind: str,
    own: Mapping[str, torch.Tensor],
    initial: Mapping[str, torch.Tensor],
    scale: float | None = None,
) -> dict[str, torch.Tensor]:
    """The model a compromised peer sends instead of ``own``.

    Non-floating tensors (counters) are sent as they are.
    """
    value = attack_scale(kind, scale)
    poisoned: dict[str, torch.Tensor] = {}
    for name, tensor in own.items():
        if not tensor.is_floating_point():
            poisoned[name] = tensor.detach().clone()
        elif kind == "constant":
            poisoned[name] = torch.full_like(tensor, value)
        elif kind == "scaled-initial":
            poisoned[name] = initial[name].detach() * value
        else:
            poisoned[name] = tensor.detach() * value
    return poisoned
