"""Step decay of the learning rate by round, the same on the server and every client.

``StepDecay(milestones=(200, 300), gamma=0.1)`` multiplies the learning rate by 0.1
for every milestone already passed, like PyTorch's ``MultiStepLR``: rounds 1-200 use
``lr``, rounds 201-300 ``0.1·lr``, later rounds ``0.01·lr``. The factor is a function
of the round (for replicas: of the version the update produces, which is the round
that made it), so every replica that applies the same updates still holds the same
bits, and a replica rebuilt from a snapshot needs no extra state.

Run-config keys ``lr-milestones = "200,300"`` and ``lr-gamma = 0.1``
(:meth:`StepDecay.parse`); empty milestones (the default) leave the rate constant.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NO_DECAY", "StepDecay"]


@dataclass(frozen=True)
class StepDecay:
    """Multiply the learning rate by ``gamma`` after each round in ``milestones``.

    Parameters
    ----------
    milestones : tuple[int, ...]
        Strictly increasing rounds (>= 1); the rate drops for the rounds *after* each.
    gamma : float
        Factor per milestone, in (0, 1].
    """

    milestones: tuple[int, ...] = ()
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.gamma <= 1:
            raise ValueError(f"lr-gamma must be in (0, 1], got {self.gamma}")
        if any(m < 1 for m in self.milestones):
            raise ValueError(f"lr-milestones must be rounds >= 1, got {self.milestones}")
        if any(b <= a for a, b in zip(self.milestones, self.milestones[1:], strict=False)):
            raise ValueError(f"lr-milestones must increase strictly, got {self.milestones}")

    @classmethod
    def parse(cls, milestones: str, gamma: float = 0.1) -> StepDecay:
        """Build from the run-config text ``"200,300"`` (empty: no decay).

        Raises
        ------
        ValueError
            Naming the key when an entry is not an integer, or the rounds or gamma are bad.
        """
        items = [part.strip() for part in milestones.split(",")] if milestones.strip() else []
        try:
            rounds = tuple(int(item) for item in items)
        except ValueError:
            raise ValueError(
                f"lr-milestones must be comma-separated rounds like '200,300', got {milestones!r}"
            ) from None
        return cls(rounds, gamma)

    def factor(self, round_: int) -> float:
        """The multiplier of the base rate in round ``round_`` (1-based)."""
        passed = sum(1 for m in self.milestones if round_ > m)
        return float(self.gamma**passed)

    def rate(self, base: float, round_: int) -> float:
        """``base × factor(round_)``."""
        return base * self.factor(round_)


NO_DECAY = StepDecay()
