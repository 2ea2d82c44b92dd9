"""Aggregation and downlink: combine the admitted gradients, encode the broadcast.

The broadcast is the exact shared-scale sum of the ternary codes when it applies, else the
aggregate re-encoded with the round's compressor and server-side error feedback
(:mod:`fedddl.compression.codecs.downlink`). This part keeps the downlink state a checkpoint saves:
the error-feedback residuals and the shared scales of the next round.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fedddl.compression import ResidualMemory
from fedddl.compression import make_compressor as build_compressor
from fedddl.compression.codecs.downlink import encode_bundle, encode_reencoded, encode_shared_sum
from fedddl.defenses import Defenses
from fedddl.seeding import derive_seed
from fedddl.sync.aggregation import Aggregate, Contribution
from fedddl.sync.messages import ClientReply
from fedddl.sync.robust import make_aggregator
from fedddl.sync.scale_bound import ScaleBound

__all__ = ["Broadcast"]


class Broadcast:
    """The round's aggregator and downlink encoder.

    Parameters
    ----------
    param_names : Sequence[str]
        The trainable parameters in order (the order of the shared scales).
    dense : frozenset[str]
        The fp32-exempt parameters (sent dense both ways).
    seed : int
        Seeds the server-side compressor.
    clip_sigma : float
        Clipping of compressors with the ``ternary`` capability.
    defenses : Defenses
        Chooses the aggregator (:mod:`fedddl.sync.robust`).
    scale_bucket : int
        Scale buckets of the re-encoded downlink's ternary compressor (0: per tensor).

    Attributes
    ----------
    memory : ResidualMemory
        Server-side error-feedback residuals of the re-encoded downlink.
    shared_scales : torch.Tensor | None
        The next round's shared scales (one per trainable parameter), when the shared sum
        applies.
    """

    def __init__(
        self,
        param_names: Sequence[str],
        dense: frozenset[str],
        seed: int,
        clip_sigma: float,
        defenses: Defenses,
        scale_bucket: int = 0,
    ) -> None:
        self.param_names = list(param_names)
        self.scale_bucket = scale_bucket
        self.dense = dense
        self.seed = seed
        self.clip_sigma = clip_sigma
        self._aggregator = make_aggregator(
            defenses.aggregator, trim_fraction=defenses.trim_fraction
        )
        self.memory = ResidualMemory()
        self.shared_scales: torch.Tensor | None = None

    def code_scales(self, shared_sum: bool) -> dict[str, float] | None:
        """The shared scales of the ternary-coded tensors, when the shared sum applies."""
        if not shared_sum or self.shared_scales is None:
            return None
        pairs = zip(self.param_names, self.shared_scales.tolist(), strict=True)
        return {n: s for n, s in pairs if n not in self.dense}

    def combine(
        self, contributions: Iterable[Contribution], code_scales: dict[str, float] | None
    ) -> Aggregate:
        """The configured aggregator over the admitted contributions."""
        return self._aggregator(contributions, code_scales)

    def encode(self, server_round: int, aggregate: Aggregate, compressor: str) -> tuple[bytes, str]:
        """The broadcast bytes of ``aggregate``, its pooled statistics included, sealed once,
        and their format (``"shared-scale-sum"`` or ``"encoded"``, with ``compressor`` and
        this part's error feedback)."""
        if aggregate.code_sums is not None and self.shared_scales is not None:
            ternary = [n for n in self.param_names if n not in self.dense]
            scales = dict(zip(self.param_names, self.shared_scales.tolist(), strict=True))
            sums = {n: aggregate.code_sums[n] for n in ternary}
            shapes = {n: tuple(aggregate.gradient[n].shape) for n in ternary}
            count = len(aggregate.contributors)
            exact = encode_shared_sum(sums, {n: scales[n] for n in ternary}, shapes, count)
            dense = {n: aggregate.gradient[n] for n in self.param_names if n in self.dense}
            return encode_bundle(exact, dense, aggregate.statistics), "shared-scale-sum"
        encoder = build_compressor(
            compressor,
            seed=derive_seed(self.seed, server_round, 1 << 40),
            clip_sigma=self.clip_sigma,
            scale_bucket=self.scale_bucket,
        )
        payload = encode_reencoded(aggregate.gradient, encoder, self.memory, dense=self.dense)
        return encode_bundle(payload, statistics=aggregate.statistics), "encoded"

    def update_shared_scales(self, contributors: list[ClientReply], bound: ScaleBound) -> None:
        """The next round's shared scales: per tensor the largest reported local scale, at
        most ``bound.factor ×`` the lower median of the reported ones (one client cannot set
        everyone's scale)."""
        size = (len(self.param_names),)
        reported = [
            r.scales.to(torch.float32)
            for r in contributors
            if r.scales is not None and tuple(r.scales.shape) == size
        ]
        if not reported:
            self.shared_scales = None
            return
        stacked = torch.stack(reported)
        shared = stacked.max(dim=0).values
        if bound.enabled:
            median = stacked.sort(dim=0).values[(len(reported) - 1) // 2]
            shared = torch.minimum(shared, median * bound.factor)
        self.shared_scales = shared
