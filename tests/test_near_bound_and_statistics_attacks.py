"""Attacks just under the scale bound and forged BatchNorm statistics (kinds and defences)."""

from __future__ import annotations

import pytest
import torch

from fedddl.attacks.spec import Attack, parse_attack
from fedddl.attacks.tamper import forged_statistics, rewrite_payload
from fedddl.compression import (
    IdentityCompressor,
    TernaryCompressor,
    decode_update,
    encode_update,
    read_header,
)
from fedddl.running_stats import StatisticsPool


def test_near_bound_and_bn_statistics_parse_with_a_factor() -> None:
    assert parse_attack("near-bound:7.9") == Attack("near-bound", 7.9)
    assert parse_attack("bn-statistics:2") == Attack("bn-statistics", 2.0)
    with pytest.raises(ValueError, match="needs an argument"):
        parse_attack("near-bound")


def test_near_bound_negates_the_codes_at_f_times_the_scale() -> None:
    torch.manual_seed(0)
    grads = {"w": torch.randn(64), "b": torch.randn(3)}
    honest = encode_update(grads, TernaryCompressor(seed=0), dense=("b",))
    forged = rewrite_payload(honest, Attack("near-bound", 7.9))
    h, f = decode_update(honest), decode_update(forged)
    scale = {e.name: e.scale for e in read_header(honest) if e.codec is not None}["w"]
    assert {e.name: e.scale for e in read_header(forged) if e.codec}["w"] == pytest.approx(
        7.9 * scale, rel=1e-6
    )
    assert torch.equal(torch.sign(f["w"]), -torch.sign(h["w"]))
    assert torch.allclose(f["b"], -7.9 * h["b"])


def _stats(mean: float, var: float) -> dict[str, torch.Tensor]:
    return {
        "bn.mean": torch.full((4,), mean),
        "bn.var": torch.full((4,), var),
        "bn.count": torch.tensor([100.0]),
    }


def test_forged_statistics_push_the_mean_and_zero_the_variance() -> None:
    honest = _stats(0.5, 2.0)
    honest["bn.mean"][0] = -1.0
    forged = decode_update(forged_statistics(encode_update(honest, IdentityCompressor()), 7.9))
    assert torch.allclose(forged["bn.mean"], torch.full((4,), 7.9))
    assert torch.equal(forged["bn.var"], torch.zeros(4))


def test_robust_pool_ignores_one_forged_client_in_ten_and_the_mean_pool_does_not() -> None:
    honest = [_stats(0.1 * i, 1.0 + 0.01 * i) for i in range(9)]
    forged = _stats(7.9 * 0.8, 0.0)
    robust, plain = StatisticsPool(robust=True), StatisticsPool()
    for stats in [*honest, forged]:
        robust.add(stats)
        plain.add(stats)
    got, mean = robust.result(), plain.result()
    assert float(got["bn.mean"].max()) <= 0.8  # within the honest range
    assert 0.9 < float(got["bn.var"].min()) < 1.5
    assert float(mean["bn.mean"].max()) > 0.9  # the equal-weight mean is pulled
    assert float(got["bn.count"]) == 1000
