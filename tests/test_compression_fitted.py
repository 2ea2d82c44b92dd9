"""``ternary-fitted-base3``: threshold ternary codes with the least-squares scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedddl.compression import (
    TernaryCompressor,
    TernaryPayload,
    decode_update,
    encode_update,
    make_compressor,
)
from fedddl.compression.algorithms.ternary_fitted import FittedTernaryCompressor
from fedddl.sync.screening import PayloadSpec
from tests.support.tensors import heavy_tailed

FITTED, THRESHOLD = "ternary-fitted-base3", "ternary-threshold-base3"


@pytest.mark.parametrize("threshold", [0.5, 0.25])
def test_same_codes_as_threshold_ternary_with_the_mean_magnitude_as_scale(
    threshold: float,
) -> None:
    g = heavy_tailed(10_007, 0)
    fitted, _ = FittedTernaryCompressor(threshold=threshold).compress(g)
    plain, _ = TernaryCompressor(deterministic=True, codec="base3", threshold=threshold).compress(g)
    assert isinstance(fitted, TernaryPayload) and isinstance(plain, TernaryPayload)
    assert torch.equal(fitted.codes, plain.codes) and fitted.codec == "base3"
    fired = g.abs()[g.abs() > np.float32(threshold * plain.scale)]
    assert fitted.scale == pytest.approx(float(fired.double().mean()), rel=1e-6)
    assert fitted.scale != plain.scale


def test_error_is_below_the_threshold_ternarys_and_contractive() -> None:
    g = {"a": heavy_tailed(4_000, 1).reshape(40, 100), "b": torch.randn(3_000)}
    fitted = decode_update(encode_update(g, make_compressor(FITTED, seed=0, clip_sigma=2.5)))
    plain = decode_update(encode_update(g, make_compressor(THRESHOLD, seed=0, clip_sigma=2.5)))
    for name, tensor in g.items():
        error = float((fitted[name] - tensor).norm())
        assert error < float((plain[name] - tensor).norm())
        assert error < float(tensor.norm())
        assert fitted[name].shape == tensor.shape


def test_zero_and_constant_tensors() -> None:
    out = decode_update(encode_update(
        {"z": torch.zeros(10), "c": torch.full((10,), 0.5)}, FittedTernaryCompressor()
    ))  # fmt: skip
    assert torch.equal(out["z"], torch.zeros(10))
    assert torch.allclose(out["c"], torch.full((10,), 0.5))


def test_no_shared_scale_and_screened_like_threshold_ternary() -> None:
    compressor = FittedTernaryCompressor()
    with pytest.raises(ValueError, match="no shared scale"):
        compressor.compress(torch.ones(4), scale=2.0)
    assert not compressor.ternary  # not offered for scaler sharing
    g = {"w": heavy_tailed(500, 2)}
    spec = PayloadSpec.for_shapes({"w": (500,)}, compressor)
    assert spec.ternary_codecs == frozenset({"base3"}) and spec.dense_below == 0
    decoded = spec.check(encode_update(g, compressor), 0).decode()
    assert torch.equal(decoded["w"], decode_update(encode_update(g, compressor))["w"])
