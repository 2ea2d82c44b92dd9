"""User extensions: a compressor registered by name and a strategy given as ``module:Class``.

This module is itself the plugin (``plugins = "tests.test_strategy_plugins"``), exactly as
the README example: importing it registers ``scaled-sign``.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg

from clients.client_app import make_client_app
from clients.localized import model_factory
from fedddl.app_config import AppConfig
from fedddl.compression import Compressor, Context, TernaryPayload, pack_codes, register_compressor
from strategies.counting_grid import CountingGrid
from strategies.inline_grid import InlineGrid
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


def test_user_strategy_and_compressor_by_name_run_end_to_end() -> None:
    cfg = AppConfig(
        num_server_rounds=3,
        strategy="tests.test_strategy_plugins:SignGrad",
        plugins="tests.test_strategy_plugins",
    )
    strategy = build_strategy(cfg, model_factory(cfg))
    assert type(strategy) is SignGrad
    grid = CountingGrid(InlineGrid(make_client_app(cfg), 3))
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=3)
    assert all(len(r.accepted) == 3 and r.replicas_equal for r in strategy.reports)
    # The broadcast is the re-encoded aggregate: every value is +-s or 0 per tensor.
    from strategies.downlink import decode_broadcast

    update = decode_broadcast(strategy.log.since(2)[0][1])
    for t in update.values():
        assert torch.unique(t.abs()).numel() <= 2


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
        build_strategy(AppConfig(compressor="nope"), model_factory(AppConfig()))
    with pytest.raises(ValueError, match="cannot import 'nope_mod'"):
        AppConfig(plugins="nope_mod").import_plugins()
