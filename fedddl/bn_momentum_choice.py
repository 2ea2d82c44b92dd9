"""What ``bn-momentum = "auto"`` (the default) means for a run.

Every replica moves its BatchNorm running statistics once a round, by the round's pooled
statistics (:mod:`fedddl.running_stats`), so a layer's momentum ``m`` makes them an average
over about the last ``1/m`` rounds' weights. With clients sampled (``fraction-train`` < 1)
``auto`` is :data:`SAMPLED_MOMENTUM`: the statistics follow the weights within about two
rounds. At full participation it is 0, the model's own momentum (torch's 0.1 in the built-in
models). An explicit value is used as given (0: the model's own). The weights never depend on
it, only the running statistics evaluation uses. Server and clients resolve it from the same
run config, so every replica's buffers stay identical.
"""

from __future__ import annotations

import math

__all__ = ["AUTO", "MODEL_OWN", "SAMPLED_MOMENTUM", "parse_bn_momentum", "resolve_bn_momentum"]

AUTO = "auto"
#: The model's own momentum (every BatchNorm layer left as built).
MODEL_OWN = 0.0
#: ``auto``'s momentum when fewer than all clients train a round.
SAMPLED_MOMENTUM = 0.5


def parse_bn_momentum(value: object) -> float | str:
    """``"auto"`` or a float in ``[0, 1]`` from a run-config or command-line value (a number,
    or a string of one); raise ``ValueError`` naming the choices otherwise."""
    if value == AUTO:
        return AUTO
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or not 0 <= number <= 1:
        raise ValueError(
            f"bn-momentum must be 'auto', 0 (the model's own) or in (0, 1], got {value!r}"
        )
    return number


def resolve_bn_momentum(value: float | str, *, fraction_train: float) -> float:
    """The BatchNorm momentum a run sets (0: the model's own): ``value`` itself unless it is
    ``"auto"``, then :data:`SAMPLED_MOMENTUM` at ``fraction_train`` < 1, else
    :data:`MODEL_OWN`. Raises ``ValueError`` for a bad ``value``."""
    momentum = parse_bn_momentum(value)
    if isinstance(momentum, str):  # AUTO
        return SAMPLED_MOMENTUM if fraction_train < 1 else MODEL_OWN
    return momentum
