"""TernaryCompressor against TernGrad's definition and a bit-exact reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedddl.compression import IdentityCompressor, TernaryCompressor, TernaryPayload
from tests.support.reference import python_pack, reference_codes


def _sample_mean(
    g: torch.Tensor, copies: int, compressor: TernaryCompressor, scale: float | None = None
) -> tuple[torch.Tensor, float]:
    """Mean of ``copies`` independent ternarisations of ``g`` (one call on a tiled tensor)."""
    tiled = g.repeat(copies)
    payload, ctx = compressor.compress(tiled, scale=scale)
    assert isinstance(payload, TernaryPayload)
    decoded = compressor.decompress(payload, ctx).view(copies, -1)
    return decoded.mean(dim=0), payload.scale


def _five_sigma_check(g: torch.Tensor, mean: torch.Tensor, s: float, copies: int) -> None:
    variance = (s * g.abs() - g * g).clamp_min(0).double()
    bound = 5 * torch.sqrt(variance / copies) + 2.0**-17 * s + 1e-7
    assert bool(((mean.double() - g.double()).abs() <= bound).all())


def test_unbiased_without_clipping() -> None:
    g = torch.randn(257, generator=torch.Generator().manual_seed(1))
    g[3] = 0.0
    copies = 4000
    mean, s = _sample_mean(g, copies, TernaryCompressor(clip_sigma=None, seed=7))
    assert s == pytest.approx(float(g.abs().max()), rel=1e-6)
    _five_sigma_check(g, mean, s, copies)
    assert float(mean[3]) == 0.0


def test_shared_scale_is_unbiased_and_used() -> None:
    g = torch.randn(257, generator=torch.Generator().manual_seed(2))
    compressor = TernaryCompressor(clip_sigma=None, seed=3)
    shared = 3.0 * float(compressor.local_scale(g) or 0.0)
    mean, s = _sample_mean(g, 4000, compressor, scale=shared)
    assert s == pytest.approx(shared, rel=1e-7)
    _five_sigma_check(g, mean, s, 4000)


def test_shared_scale_below_local_is_rejected() -> None:
    g = torch.randn(100)
    compressor = TernaryCompressor()
    local = compressor.local_scale(g)
    assert local is not None
    with pytest.raises(ValueError, match="below"):
        compressor.compress(g, scale=local * 0.5)
    with pytest.raises(ValueError, match="finite"):
        compressor.compress(g, scale=math.nan)


def test_values_are_exactly_minus_zero_plus_scale() -> None:
    g = torch.randn(4, 33, 7)
    compressor = TernaryCompressor(seed=5)
    payload, ctx = compressor.compress(g)
    assert isinstance(payload, TernaryPayload)
    out = compressor.decompress(payload, ctx)
    assert out.shape == g.shape and out.dtype == g.dtype
    s = payload.scale
    assert set(out.flatten().tolist()) <= {-s, 0.0, s}
    # a firing element keeps its sign
    fired = out != 0
    assert bool((torch.sign(out[fired]) == torch.sign(g[fired])).all())


@pytest.mark.parametrize("numel", [1, 5, 1001, 81920 + 7])
@pytest.mark.parametrize("clip_sigma", [None, 1.0])
def test_stochastic_codes_match_reference_bit_for_bit(numel: int, clip_sigma: float | None) -> None:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    compressor = TernaryCompressor(clip_sigma=clip_sigma, seed=11)
    payload, _ = compressor.compress(g)
    assert isinstance(payload, TernaryPayload)
    expected = python_pack(reference_codes(g.numpy(), payload.scale, seed=11), "2bit")
    assert bytes(payload.codes.numpy()) == expected


def test_shared_scale_with_clipping_matches_reference() -> None:
    g = torch.randn(2000, generator=torch.Generator().manual_seed(4))
    compressor = TernaryCompressor(clip_sigma=1.0, seed=2)
    bound = compressor.local_scale(g)
    assert bound is not None and bound < float(g.abs().max())
    payload, _ = compressor.compress(g, scale=2 * bound)
    assert isinstance(payload, TernaryPayload)
    expected = reference_codes(g.numpy(), payload.scale, seed=2, clip_bound=bound)
    assert bytes(payload.codes.numpy()) == python_pack(expected, "2bit")


def test_same_seed_same_codes_and_stream_advances() -> None:
    g = torch.randn(5000)
    a, b = TernaryCompressor(seed=9), TernaryCompressor(seed=9)
    first_a, _ = a.compress(g)
    first_b, _ = b.compress(g)
    second_a, _ = a.compress(g)
    assert isinstance(first_a, TernaryPayload) and isinstance(first_b, TernaryPayload)
    assert isinstance(second_a, TernaryPayload)
    assert torch.equal(first_a.codes, first_b.codes)
    assert not torch.equal(first_a.codes, second_a.codes)
    other, _ = TernaryCompressor(seed=10).compress(g)
    assert isinstance(other, TernaryPayload)
    assert not torch.equal(first_a.codes, other.codes)


def test_codes_do_not_depend_on_thread_count() -> None:
    g = torch.randn(5 * 81920 + 3)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            payload, _ = TernaryCompressor(seed=1).compress(g)
            assert isinstance(payload, TernaryPayload)
            results.append((payload.scale, payload.codes))
    finally:
        torch.set_num_threads(before)
    for scale, codes in results[1:]:
        assert scale == results[0][0]
        assert torch.equal(codes, results[0][1])


def test_deterministic_threshold_mode() -> None:
    g = torch.tensor([1.0, -0.6, 0.4, -0.5, 0.0, 0.51, -1.0])
    compressor = TernaryCompressor(clip_sigma=None, deterministic=True, threshold=0.5)
    payload, ctx = compressor.compress(g)
    out = compressor.decompress(payload, ctx)
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 1.0, -1.0]))
    again = compressor.decompress(*compressor.compress(g))
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_clipping_to_c_sigma() -> None:
    g = torch.randn(10000, generator=torch.Generator().manual_seed(0))
    g[0] = 50.0  # an outlier far beyond 2.5 sigma
    sigma = float(g.double().std(correction=0))
    compressor = TernaryCompressor(clip_sigma=2.5, seed=0)
    payload, ctx = compressor.compress(g)
    assert isinstance(payload, TernaryPayload)
    assert payload.scale == pytest.approx(2.5 * sigma, rel=1e-5)
    out = compressor.decompress(payload, ctx)
    beyond = g.abs() >= payload.scale
    # clipped elements have probability 1: always exactly sign(g) * s
    torch.testing.assert_close(out[beyond], torch.sign(g[beyond]) * payload.scale)
    unclipped, _ = TernaryCompressor(clip_sigma=None).compress(g)
    assert isinstance(unclipped, TernaryPayload)
    assert unclipped.scale == pytest.approx(50.0)


def test_constant_tensor_is_not_clipped_away() -> None:
    g = torch.full((1000,), 0.3)
    compressor = TernaryCompressor(clip_sigma=2.5)
    out = compressor.decompress(*compressor.compress(g))
    torch.testing.assert_close(out, g)
    one = torch.tensor([-2.0])
    torch.testing.assert_close(compressor.decompress(*compressor.compress(one)), one)


def test_all_zero_and_empty_tensors() -> None:
    compressor = TernaryCompressor()
    for g in (torch.zeros(13), torch.zeros(0), torch.zeros(2, 0, 3)):
        payload, ctx = compressor.compress(g)
        assert isinstance(payload, TernaryPayload) and payload.scale == 0.0
        torch.testing.assert_close(compressor.decompress(payload, ctx), g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_keep_their_dtype(dtype: torch.dtype) -> None:
    g = torch.randn(3, 41).to(dtype)
    compressor = TernaryCompressor(seed=0)
    payload, ctx = compressor.compress(g)
    out = compressor.decompress(payload, ctx)
    assert out.dtype == dtype and out.shape == g.shape
    assert isinstance(payload, TernaryPayload)
    s = torch.tensor(payload.scale, dtype=dtype)
    assert set(out.flatten().tolist()) <= {-float(s), 0.0, float(s)}


def test_min_numel_leaves_small_tensors_dense() -> None:
    compressor = TernaryCompressor(min_numel=10)
    bias = torch.randn(9)
    out = compressor.decompress(*compressor.compress(bias))
    assert torch.equal(out, bias)
    assert compressor.local_scale(bias) is None
    with pytest.raises(ValueError, match="min_numel"):
        compressor.compress(bias, scale=1.0)
    big, _ = compressor.compress(torch.randn(10))
    assert isinstance(big, TernaryPayload)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("compressor", [TernaryCompressor(), IdentityCompressor()])
def test_non_finite_input_is_an_error(bad: float, compressor: object) -> None:
    g = torch.randn(100)
    g[57] = bad
    assert isinstance(compressor, (TernaryCompressor, IdentityCompressor))
    with pytest.raises(ValueError, match="NaN or Inf"):
        compressor.compress(g)


def test_float64_beyond_float32_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        TernaryCompressor().compress(torch.tensor([1e300, 1.0], dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip_sigma": 0.0},
        {"clip_sigma": -1.0},
        {"threshold": 1.5},
        {"min_numel": -1},
        {"codec": "base4"},
        {"seed": -1},
    ],
)
def test_bad_options_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TernaryCompressor(**kwargs)  # type: ignore[arg-type]


def test_bad_tensor_types_are_rejected() -> None:
    with pytest.raises(TypeError, match="dtype"):
        TernaryCompressor().compress(torch.arange(5))
    with pytest.raises(TypeError, match="Tensor"):
        TernaryCompressor().compress(np.zeros(3))  # type: ignore[arg-type]


def test_scaler_sharing_helpers_across_workers() -> None:
    from fedddl.compression import (
        ResidualMemory,
        decode_update,
        encode_update,
        local_scales,
        max_scales,
    )

    workers = [TernaryCompressor(seed=i, min_numel=4) for i in range(3)]
    grads = [{"w": torch.randn(40) * (i + 1), "b": torch.randn(3)} for i in range(3)]
    memory = ResidualMemory()
    mine = [local_scales(g, c, memory) for g, c in zip(grads, workers, strict=True)]
    assert all(set(m) == {"w"} for m in mine)  # "b" is below min_numel: dense, no scale
    shared = max_scales(mine)
    assert shared["w"] == max(m["w"] for m in mine)
    for g, c in zip(grads, workers, strict=True):
        decoded = decode_update(encode_update(g, c, scales=shared))
        assert set(decoded["w"].abs().flatten().tolist()) <= {0.0, shared["w"]}
        assert torch.equal(decoded["b"], g["b"])
    with pytest.raises(ValueError, match="finite"):
        max_scales([{"w": math.inf}])
