"""User extensions: a compressor registered by name and a strategy given as ``module:Class``.

This module is itself the plugin (``plugins = "tests.test_strategy_plugins"``), exactly as
the README example: importing it registers ``scaled-sign``.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.compression import (
    Compressor,
    Context,
    TernaryPayload,
    decode_update,
    pack_codes,
    register_compressor,
)
from fedddl.flower.grid import CountingGrid
from fedddl.flower.inline_grid import InlineGrid
from fedddl.sync import Aggregate, Contribution
from strategies.registry import build_strategy, load_strategy_class
from strategies.terngrad import TernGrad


class ScaledSign(Compressor):
    """Sign of every value times the tensor's mean magnitude (biased, 2 bits per value)."""

    name = "scaled-sign"

    def compress(
        self, tensor: torch.Tensor, *, scale: float | None = None
    ) -> tuple[TernaryPayload, Context]:
        if scale is not None:
            raise ValueError("scaled-sign has no shared scale")
        flat = tensor.detach().reshape(-1).to(torch.float32)
        codes = torch.where(flat > 0, 1, torch.where(flat < 0, 2, 0)).to(torch.uint8)
        payload = TernaryPayload(
            pack_codes(codes, "2bit"), float(flat.abs().mean()), flat.numel(), "2bit"
        )
        return payload, Context(tuple(tensor.shape), tensor.dtype)


register_compressor("scaled-sign", ScaledSign, overwrite=True)


class SignGrad(TernGrad):
    """TernGrad's protocol with the user's compressor: override one method."""

    def compressor_name(self) -> str:
        return "scaled-sign"


class MedianTernGrad(TernGrad):
    """The README's example: coordinate-wise median instead of the mean (one method)."""

    def aggregate_gradients(self, contributions: Iterable[Contribution]) -> Aggregate:
        kept = [(c.reply, {k: v.clone() for k, v in c.gradient.items()}) for c in contributions]
        names = kept[0][1] if kept else {}
        median = {k: torch.stack([g[k] for _, g in kept]).median(dim=0).values for k in names}
        return Aggregate(median, [r for r, _ in kept])


def test_user_strategy_and_compressor_by_name_run_end_to_end() -> None:
    cfg = AppConfig(
        num_server_rounds=3,
        strategy="tests.test_strategy_plugins:SignGrad",
        plugins="tests.test_strategy_plugins",
        fp32_logits=False,  # every tensor through the user's compressor
    )
    strategy = build_strategy(cfg, cfg.model_factory())
    assert type(strategy) is SignGrad
    grid = CountingGrid(InlineGrid(make_client_app(cfg), 3))
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=3)
    assert all(len(r.accepted) == 3 and r.replicas_equal for r in strategy.server.reports)
    # The broadcast is the re-encoded aggregate: every value is +-s or 0 per tensor.
    from fedddl.compression.codecs.downlink import decode_broadcast

    update = decode_broadcast(strategy.server.log.since(2)[0][1])
    for t in update.values():
        assert torch.unique(t.abs()).numel() <= 2


def test_one_method_override_replaces_the_aggregation() -> None:
    """MedianTernGrad's aggregate is the coordinate median of the decoded replies."""
    cfg = AppConfig(num_server_rounds=2, strategy="tests.test_strategy_plugins:MedianTernGrad")
    strategy = build_strategy(cfg, cfg.model_factory())
    assert isinstance(strategy, MedianTernGrad)
    payloads: list[bytes] = []

    def tamper(message: Message, reply: Message) -> Message:
        payloads.append(bytes(reply.content["update"]["payload"].data))  # type: ignore[index,union-attr]
        return reply

    seen: list[dict[str, torch.Tensor]] = []
    encode = strategy.encode_downlink

    def spy(server_round: int, aggregate: Aggregate) -> tuple[bytes, str]:
        seen.append({k: v.clone() for k, v in aggregate.gradient.items()})
        return encode(server_round, aggregate)

    strategy.encode_downlink = spy  # type: ignore[method-assign]
    grid = InlineGrid(make_client_app(cfg), 5, tamper=tamper)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=1)
    decoded = [decode_update(p) for p in payloads]
    assert len(decoded) == 5 and len(seen) == 1
    for name, got in seen[0].items():
        want = torch.stack([d[name] for d in decoded]).median(dim=0).values
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        mean = torch.stack([d[name] for d in decoded]).mean(dim=0)
        assert not torch.equal(got, mean)  # really not the default mean


def test_strategy_specs_are_checked() -> None:
    with pytest.raises(ValueError, match="must look like"):
        load_strategy_class("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_strategy_class("not_a_module_xyz:Thing")
    with pytest.raises(ValueError, match="not a flwr Strategy"):
        load_strategy_class("tests.test_strategy_plugins:ScaledSign")
    assert load_strategy_class("flwr.serverapp.strategy:FedAvg") is FedAvg


def test_unknown_compressor_and_plugin_are_named() -> None:
    with pytest.raises(ValueError, match="unknown compressor 'nope'"):
        build_strategy(AppConfig(compressor="nope"), AppConfig().model_factory())
    with pytest.raises(ValueError, match="cannot import 'nope_mod'"):
        AppConfig(plugins="nope_mod").import_plugins()
