"""Which attack a run injects, and which partitions run it.

An attack is ``KIND`` or ``KIND:ARG`` (run-config key ``attack``, ``fedddl simulate
--attack``), run by ``num-attackers`` clients. The kinds (what the attacker's reply does;
every message stays well-formed: valid records, valid payload, correct CRC):

==================  ==========================================================================
kind                the attacker's reply
==================  ==========================================================================
``scale:S``         its honest gradient with every ternary scale multiplied by ``S`` (capped
                    at the largest finite float32), and so are the local scales it reports
                    for the ``shared-scale-sum`` downlink, and, for a model with BatchNorm,
                    its statistics' means (``× S``) and variances (``× S²``)
``sign-flip``       its honest gradient with every code negated (honest scales)
``near-bound:F``    its honest gradient negated, every scale (dense value) ``× F`` (just under
                    a scale bound of ``k`` for ``F < k``); reported local scales and
                    statistics honest
``bn-statistics:F`` its honest gradient; for a model with BatchNorm, every layer's statistics
                    forged: each channel's mean set to ``F ×`` the layer's largest honest
                    ``|mean|``, variance 0
``adaptive:F``      its honest gradient with its largest non-zero values (a quarter of
                    them) negated, few enough that its agreement with the others' signs
                    stays above the direction check's threshold, every scale (dense
                    value) ``× F`` (:mod:`fedddl.attacks.adaptive`); reported local scales
                    and statistics honest
``all-plus``        every code +1 at its honest scales
``nan-metrics``     its honest gradient, ``loss = NaN``
``inf-metrics``     its honest gradient, ``loss = +Inf``
``huge-examples``   its honest gradient, ``num-examples = 2**62``
``resync-spam``     a bare resync request (version -1, "I lost my state") every round
``fingerprint-lie`` its honest gradient with a wrong replica fingerprint
``many-tensors``    a valid payload of 65,536 one-element tensors
==================  ==========================================================================

:func:`attacker_partitions` picks the attacking partition ids from the run's seed, the same
in the server and every client process.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["ATTACK_KINDS", "Attack", "attacker_partitions", "parse_attack"]

ATTACK_KINDS: tuple[str, ...] = (
    "scale",
    "sign-flip",
    "near-bound",
    "bn-statistics",
    "adaptive",
    "all-plus",
    "nan-metrics",
    "inf-metrics",
    "huge-examples",
    "resync-spam",
    "fingerprint-lie",
    "many-tensors",
)
_WITH_ARG = {"scale", "near-bound", "bn-statistics", "adaptive"}


@dataclass(frozen=True)
class Attack:
    """A parsed attack.

    Attributes
    ----------
    kind : str
        One of :data:`ATTACK_KINDS`.
    arg : float | None
        The argument (the factor of ``scale``, ``near-bound``, ``bn-statistics``,
        ``adaptive``), else None.
    """

    kind: str
    arg: float | None = None

    def __str__(self) -> str:
        return self.kind if self.arg is None else f"{self.kind}:{self.arg:g}"


def parse_attack(spec: str) -> Attack | None:
    """Parse ``KIND[:ARG]``; ``""`` is no attack.

    Raises
    ------
    ValueError
        Naming an unknown kind, a missing, extra or bad argument.
    """
    spec = spec.strip()
    if not spec:
        return None
    kind, sep, raw = spec.partition(":")
    if kind not in ATTACK_KINDS:
        raise ValueError(f"attack kind must be one of {', '.join(ATTACK_KINDS)}, got {kind!r}")
    if kind not in _WITH_ARG:
        if sep:
            raise ValueError(f"attack {kind!r} takes no argument, got {spec!r}")
        return Attack(kind)
    if not sep:
        raise ValueError(f"attack {kind!r} needs an argument: {kind}:F")
    try:
        arg = float(raw)
    except ValueError:
        raise ValueError(f"attack {spec!r}: {raw!r} is not a number") from None
    if not (math.isfinite(arg) and arg > 0):
        raise ValueError(f"attack {spec!r}: the factor must be finite and > 0")
    return Attack(kind, arg)


def attacker_partitions(num_partitions: int, num_attackers: int, seed: int) -> list[int]:
    """The partition ids that attack: ``num_attackers`` of ``range(num_partitions)``, chosen
    with ``random.Random(seed)`` (sorted).

    Raises
    ------
    ValueError
        If ``num_attackers`` is negative or more than ``num_partitions``.
    """
    if not 0 <= num_attackers <= num_partitions:
        raise ValueError(
            f"num-attackers must be in [0, {num_partitions}] (the number of clients), "
            f"got {num_attackers}"
        )
    chosen = random.Random(f"fedddl-attackers-{seed}").sample(range(num_partitions), num_attackers)
    return sorted(chosen)
