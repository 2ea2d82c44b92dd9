"""Stand-in uplink quantizers for the drop-in accuracy bench (the eighth round's screen).

Each registers as a compressor that sends the *quantized values dense* (float32), so a run
measures what the quantizer does to accuracy, not bytes; the byte ratio of its codes is
computed, not measured. Then it runs :mod:`simulations.bench_dropin_accuracy` with the
arguments given, e.g.::

    python -m simulations.quinary_standins --strategies fedavg --epochs 1 --seeds 0,1,2 \\
        --rounds 15 --variants "plain,dropin:downlink=false;compressor=standin-quinary-ls"

Registered: ``standin-quinary-projected`` (levels ``clip(round(g / r), -2, 2)``, ``r`` the
root mean square, projection-keeping scale capped at 1.9x least squares: what
``quinary-projected-base5`` sends), ``standin-quinary-ls`` (the same levels, least-squares
scale) and ``standin-ternary-twice`` (``ternary-projected-base3``'s codes, then the same on
the residual, both decoded and summed: about twice its bytes).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from fedddl.compression import (
    Compressor,
    Context,
    DensePayload,
    Payload,
    QuinaryProjectedCompressor,
    decode_update,
    encode_update,
    register_compressor,
)
from fedddl.compression.algorithms.ternary_projected import ProjectedTernaryCompressor

__all__ = ["KINDS", "StandIn", "register"]

#: The stand-ins, each registered as ``standin-<kind>``.
KINDS = ("quinary-projected", "quinary-ls", "ternary-twice")


class StandIn(Compressor):
    """Sends ``quantize(tensor)`` as dense float32-or-own-dtype values."""

    configurable = True

    def __init__(self, kind: str, clip_sigma: float | None = 2.5, seed: int = 0) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown stand-in {kind!r}")
        self.kind, self.clip_sigma, self.seed = kind, clip_sigma, seed
        self.name = f"standin-{kind}"

    def quantize(self, tensor: torch.Tensor) -> torch.Tensor:
        """The values the stand-in's codes would decode to."""
        if self.kind == "ternary-twice":
            ternary = ProjectedTernaryCompressor(clip_sigma=self.clip_sigma)
            first = decode_update(encode_update({"g": tensor}, ternary))["g"]
            rest = decode_update(encode_update({"g": tensor - first}, ternary))["g"]
            return first + rest
        values = tensor.detach().reshape(-1).to(torch.float64).numpy()
        levels, scale = QuinaryProjectedCompressor().levels(values)
        if self.kind == "quinary-ls" and scale:
            carried = float(np.dot(values, levels))
            scale = carried / float(np.dot(levels, levels.astype(np.float64)))
        decoded = torch.from_numpy(levels.astype(np.float64) * scale)
        return decoded.to(tensor.dtype).reshape(tensor.shape)

    def compress(
        self, tensor: torch.Tensor, *, scale: float | None = None
    ) -> tuple[Payload, Context]:
        if scale is not None:
            raise ValueError(f"{self.name} takes no shared scale")
        ctx = Context(tuple(tensor.shape), tensor.dtype)
        return DensePayload(self.quantize(tensor).contiguous()), ctx


def register() -> None:
    """Register the three stand-ins (again, if they are)."""
    for kind in KINDS:

        def factory(kind: str = kind, **kwargs: Any) -> Compressor:
            return StandIn(kind, **kwargs)

        register_compressor(f"standin-{kind}", factory, overwrite=True)


def main(argv: list[str] | None = None) -> int:
    """Register the stand-ins, then run the bench with ``argv``."""
    from simulations.bench_dropin_accuracy import main as bench

    register()
    return bench(argv)


if __name__ == "__main__":
    sys.exit(main())
