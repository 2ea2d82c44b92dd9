"""The server's quantizer onto the grid: desired steps -> integer codes at a power of two.

Per tensor and round, :meth:`GridQuantizer.quantize` keeps last round's exponent ``e``
while ``max|x| / 2**e`` lies in ``[L/4, L]`` for the desired step ``x``, and otherwise takes
the smallest ``e`` with ``max|x| <= L * 2**e`` (within ``[MIN_EXPONENT, MAX_EXPONENT]``; an
all-zero step keeps the last exponent, 0 at first). It then rounds ``y = (x + r) / 2**e``
stochastically to the integers ``c`` (``E[c] = y``), with ``r`` the error-feedback
residual, and keeps ``r' = x + r - c * 2**e``. The exponent follows ``x``, not ``x + r``:
the residual of stochastic rounding reaches nearly ``2**e``, so an exponent fitted to
``x + r`` would only ever rise. Where ``|y|`` exceeds ``L`` (only a residual can push it
there) the code saturates at ``+-L`` and the excess stays in the residual, which is then no
larger than before: nothing is lost, and ``|r'| < 2**e`` wherever nothing saturated.
Without a residual (the first round, or ``error_feedback=False``) and without
``clip_sigma``, ``E[c * 2**e] = x``.

The uniforms come from a generator seeded by ``(seed, round, tensor index)``: the same
seed and round give the same codes on any machine and thread count. With ``clip_sigma``
set, the exponent fits ``x`` clipped to ``clip_sigma`` standard deviations (TernGrad's
clipping); what the codes then cannot carry stays in the residual.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedddl.compression.codecs.count_delta import MAX_EXPONENT, MIN_EXPONENT, CountSegment
from fedddl.seeding import derive_seed

__all__ = ["GridQuantizer", "fitting_exponent"]


def fitting_exponent(peak: float, levels: int) -> int:
    """The smallest ``e`` with ``peak <= levels * 2**e`` (``peak > 0``, finite)."""
    e = math.frexp(peak)[1] - math.frexp(levels)[1]
    while peak > math.ldexp(levels, e):
        e += 1
    while peak <= math.ldexp(levels, e - 1):
        e -= 1
    return e


class GridQuantizer:
    """Stochastic rounding of desired steps onto the grid, with error feedback.

    Parameters
    ----------
    levels:
        ``L``: codes lie in ``[-L, L]`` (1 gives ternary codes); 1 to 127.
    seed:
        The run's seed; codes depend only on it, the round and the inputs.
    clip_sigma:
        Fit the exponent to each step clipped to this many standard deviations.
    error_feedback:
        Keep what the codes did not carry and add it to the next round's step.
    stochastic:
        Round stochastically (``E[c] = y``); False: to the nearest integer (contractive:
        what a code does not carry waits in the residual, no noise is added).
    """

    def __init__(
        self,
        levels: int = 1,
        seed: int = 0,
        clip_sigma: float | None = None,
        *,
        error_feedback: bool = True,
        stochastic: bool = True,
    ) -> None:
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"levels must be an int in [1, 127], got {levels!r}")
        if clip_sigma is not None and not (math.isfinite(clip_sigma) and clip_sigma > 0):
            raise ValueError(f"clip_sigma must be positive and finite, or None; got {clip_sigma}")
        self.levels = levels
        self.seed = seed
        self.clip_sigma = clip_sigma
        self.error_feedback = bool(error_feedback)
        self.stochastic = bool(stochastic)
        #: Name -> the error-feedback residual (float32).
        self.residuals: dict[str, torch.Tensor] = {}
        #: Name -> last round's exponent.
        self.exponents: dict[str, int] = {}

    def _exponent(self, name: str, peak: float, floor: int | None) -> int:
        previous = self.exponents.get(name)
        low = MIN_EXPONENT if floor is None else min(max(floor, MIN_EXPONENT), MAX_EXPONENT)
        if peak == 0.0:
            return (0 if floor is None else low) if previous is None else max(previous, low)
        if previous is not None:
            ratio = peak / math.ldexp(1.0, previous)
            if self.levels / 4 <= ratio <= self.levels:
                return max(previous, low)
        e = max(fitting_exponent(peak, self.levels), low)
        if e > MAX_EXPONENT:
            raise ValueError(f"grid quantizer: {name!r} has a step of {peak:g}, too large")
        return e

    def quantize(
        self,
        round_: int,
        steps: Mapping[str, torch.Tensor],
        floors: Mapping[str, int] | None = None,
    ) -> CountSegment:
        """The round's update (without a rebase) for the desired ``steps``; ``floors``: the
        smallest exponent per tensor (none: ``MIN_EXPONENT``).

        Raises
        ------
        ValueError
            A step that is not finite or too large for the exponent range.
        """
        units: dict[str, int] = {}
        codes: dict[str, torch.Tensor] = {}
        for index, (name, step) in enumerate(steps.items()):
            x = step.detach().to(device="cpu", dtype=torch.float32)
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"grid quantizer: {name!r} has a non-finite step")
            fitted = x
            if self.clip_sigma is not None and x.numel() > 1:
                bound = float(x.std(unbiased=False)) * self.clip_sigma
                if bound > 0:
                    fitted = x.clamp(-bound, bound)
            peak = float(fitted.abs().max()) if x.numel() else 0.0
            e = self._exponent(name, peak, None if floors is None else floors.get(name))
            residual = self.residuals.get(name)
            wanted = x if residual is None else x + residual
            scaled = (wanted.to(torch.float64) * math.ldexp(1.0, -e)).clamp(
                -self.levels, self.levels
            )
            if self.stochastic:
                low = torch.floor(scaled)
                generator = torch.Generator().manual_seed(derive_seed(self.seed, round_, index))
                uniform = torch.rand(scaled.shape, generator=generator, dtype=torch.float64)
                code = low + (uniform < scaled - low).to(torch.float64)
            else:
                code = torch.round(scaled)
            if self.error_feedback:
                self.residuals[name] = wanted - code.to(torch.float32) * math.ldexp(1.0, e)
            self.exponents[name] = e
            units[name] = e
            codes[name] = code.to(torch.int8)
        return CountSegment(rebase=False, units=units, deltas=codes)
