"""``ternary-projected-base3``: threshold ternary codes with the projection-keeping scale."""

from __future__ import annotations

import pytest
import torch

from fedddl.compression import (
    TernaryCompressor,
    TernaryPayload,
    decode_update,
    encode_update,
    make_compressor,
)
from fedddl.compression.algorithms.ternary_projected import (
    PROJECTION_CAP,
    ProjectedTernaryCompressor,
)
from fedddl.sync.screening import PayloadSpec
from tests.support.tensors import heavy_tailed

PROJECTED = "ternary-projected-base3"


@pytest.mark.parametrize("threshold", [0.5, 0.35])
def test_same_codes_as_threshold_ternary_and_the_same_length_along_the_input(
    threshold: float,
) -> None:
    g = torch.randn(10_007, generator=torch.Generator().manual_seed(0))
    projected, _ = ProjectedTernaryCompressor(threshold=threshold).compress(g)
    plain, _ = TernaryCompressor(deterministic=True, codec="base3", threshold=threshold).compress(g)
    assert isinstance(projected, TernaryPayload) and isinstance(plain, TernaryPayload)
    assert torch.equal(projected.codes, plain.codes) and projected.codec == "base3"
    clipped = g.double().clamp(-plain.scale, plain.scale)
    decoded = decode_update(encode_update({"g": g}, ProjectedTernaryCompressor(
        threshold=threshold)))["g"].double()
    # <decoded, g> = ||g||^2: the error is orthogonal to the (clipped) input
    assert float(decoded @ clipped) == pytest.approx(float(clipped @ clipped), rel=1e-5)
    assert float((decoded - clipped) @ clipped) == pytest.approx(0.0, abs=1e-3 * float(
        clipped @ clipped))


def test_the_cap_keeps_it_contractive_on_heavy_tails() -> None:
    g = {"a": heavy_tailed(4_000, 1).reshape(40, 100), "b": torch.randn(3_000),
         "c": heavy_tailed(900, 3)}
    out = decode_update(encode_update(g, make_compressor(PROJECTED, seed=0, clip_sigma=2.5)))
    for name, tensor in g.items():
        nnz = int((out[name] != 0).sum())
        assert nnz > 0 and out[name].shape == tensor.shape
        assert float((out[name] - tensor).norm()) < float(tensor.norm())


def test_the_cap_binds_when_few_values_carry_the_energy() -> None:
    g = torch.full((1_000,), 0.45)  # most of the energy just under the cut...
    g[:10] = 1.0  # ...and 10 values over it: the projection scale would be 21
    out = decode_update(encode_update({"g": g}, ProjectedTernaryCompressor(
        clip_sigma=None, threshold=0.5)))["g"]
    assert float(out.abs().max()) == pytest.approx(PROJECTION_CAP * 1.0, rel=1e-6)
    assert int((out != 0).sum()) == 10
    assert float((out - g).norm()) < float(g.norm())


def test_zero_tensor_no_shared_scale_and_screened_like_threshold_ternary() -> None:
    out = decode_update(encode_update({"z": torch.zeros(10)}, ProjectedTernaryCompressor()))
    assert torch.equal(out["z"], torch.zeros(10))
    compressor = ProjectedTernaryCompressor()
    with pytest.raises(ValueError, match="no shared scale"):
        compressor.compress(torch.ones(4), scale=2.0)
    g = {"w": heavy_tailed(500, 2)}
    spec = PayloadSpec.for_shapes({"w": (500,)}, compressor)
    assert spec.ternary_codecs == frozenset({"base3"})
    decoded = spec.check(encode_update(g, compressor), 0).decode()
    assert torch.equal(decoded["w"], decode_update(encode_update(g, compressor))["w"])


@pytest.mark.parametrize("name", [PROJECTED, "ternary-fitted-base3"])
def test_built_with_the_callers_clip_sigma_and_scale_buckets_refused(name: str) -> None:
    from fedddl.compression import takes_scale_bucket

    assert make_compressor(name, seed=0, clip_sigma=3.0).clip_sigma == 3.0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="does not take scale_bucket"):
        make_compressor(name, seed=0, clip_sigma=2.5, scale_bucket=-1)
    assert not takes_scale_bucket(name)
