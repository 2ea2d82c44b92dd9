"""Error feedback: nothing compression drops is lost, only delayed."""

from __future__ import annotations

import pytest
import torch

from fedddl.compression import (
    IdentityCompressor,
    NoMemory,
    ResidualMemory,
    TernaryCompressor,
    decode_update,
    encode_update,
)


def test_residual_accumulates_to_the_true_sum() -> None:
    generator = torch.Generator().manual_seed(0)
    memory = ResidualMemory()
    compressor = TernaryCompressor(seed=1)
    inputs_sum = {
        "w": torch.zeros(6, 7, dtype=torch.float64),
        "b": torch.zeros(5, dtype=torch.float64),
    }
    sent_sum = {k: torch.zeros_like(v) for k, v in inputs_sum.items()}
    for _ in range(25):
        grads = {
            "w": torch.randn(6, 7, generator=generator),
            "b": torch.randn(5, generator=generator),
        }
        decoded = decode_update(encode_update(grads, compressor, memory))
        for name in grads:
            inputs_sum[name] += grads[name].double()
            sent_sum[name] += decoded[name].double()
    residuals = memory.residuals
    for name in inputs_sum:
        total = sent_sum[name] + residuals[name].double()
        # float32 rounding of each step's residual is the only difference
        torch.testing.assert_close(total, inputs_sum[name], rtol=0, atol=1e-5)


def test_residual_is_compensated_minus_decompressed() -> None:
    memory = ResidualMemory()
    compressor = TernaryCompressor(seed=0)
    g = torch.randn(100)
    decoded = decode_update(encode_update({"g": g}, compressor, memory))["g"]
    torch.testing.assert_close(memory.residuals["g"], g - decoded)
    compensated = memory.compensate("g", g)
    torch.testing.assert_close(compensated, 2 * g - decoded)
    torch.testing.assert_close(memory.residuals["g"], g - decoded)  # compensate is pure


def test_identity_leaves_zero_residual_and_no_memory_is_a_no_op() -> None:
    memory = ResidualMemory()
    g = torch.randn(10)
    encode_update({"g": g}, IdentityCompressor(), memory)
    assert torch.equal(memory.residuals["g"], torch.zeros(10))
    none = NoMemory()
    assert none.compensate("g", g) is g
    none.update("g", g, g)


def test_failed_encode_leaves_memory_untouched() -> None:
    memory = ResidualMemory()
    compressor = TernaryCompressor(seed=0)
    encode_update({"a": torch.randn(8), "b": torch.randn(8)}, compressor, memory)
    before = memory.residuals
    bad = torch.randn(8)
    bad[2] = float("nan")
    with pytest.raises(ValueError, match="'b'"):
        encode_update({"a": torch.randn(8), "b": bad}, compressor, memory)
    after = memory.residuals
    assert after.keys() == before.keys()
    for name in before:
        assert torch.equal(after[name], before[name])


def test_residual_shape_mismatch_is_an_error() -> None:
    memory = ResidualMemory()
    encode_update({"a": torch.randn(8)}, TernaryCompressor(), memory)
    with pytest.raises(ValueError, match="'a'"):
        encode_update({"a": torch.randn(9)}, TernaryCompressor(), memory)
    memory.reset()
    assert memory.residuals == {}
