"""Compressors by name, and the identity baseline."""

from __future__ import annotations

import pytest
import torch

from fedddl.compression import (
    Compressor,
    Context,
    DensePayload,
    IdentityCompressor,
    Payload,
    TernaryCompressor,
    available_compressors,
    decode_update,
    encode_update,
    get_compressor,
    make_compressor,
    register_compressor,
)


class _HalfCompressor(Compressor):
    """A user compressor: halves the values (dense)."""

    name = "half-test"

    def compress(
        self, tensor: torch.Tensor, *, scale: float | None = None
    ) -> tuple[Payload, Context]:
        return DensePayload(tensor / 2), Context(tuple(tensor.shape), tensor.dtype)


def test_builtin_names() -> None:
    assert {"ternary", "ternary-base3", "identity"} <= set(available_compressors())
    assert isinstance(get_compressor("identity"), IdentityCompressor)
    ternary = get_compressor("ternary", seed=4, clip_sigma=None)
    assert isinstance(ternary, TernaryCompressor) and ternary.seed == 4
    base3 = get_compressor("ternary-base3")
    assert isinstance(base3, TernaryCompressor) and base3.codec == "base3"


def test_user_compressor_round_trips_through_the_wire() -> None:
    register_compressor("half-test", _HalfCompressor, overwrite=True)
    compressor = get_compressor("half-test")
    g = torch.randn(3, 3)
    torch.testing.assert_close(decode_update(encode_update({"g": g}, compressor))["g"], g / 2)
    with pytest.raises(ValueError, match="already registered"):
        register_compressor("half-test", _HalfCompressor)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="identity"):
        get_compressor("nope")
    with pytest.raises(TypeError, match="not a Compressor"):
        register_compressor("bad-factory-test", lambda: 3, overwrite=True)  # type: ignore[arg-type,return-value]
        get_compressor("bad-factory-test")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_identity_is_bit_exact(dtype: torch.dtype) -> None:
    g = torch.randn(17, 3).to(dtype)
    g[0, 0] = -0.0
    out = decode_update(encode_update({"g": g}, IdentityCompressor()))["g"]
    assert out.dtype == dtype
    assert torch.equal(out.view(torch.uint8), g.view(torch.uint8))
    with pytest.raises(ValueError, match="scale"):
        IdentityCompressor().compress(g, scale=1.0)


def test_make_compressor_follows_a_name_registered_again() -> None:
    register_compressor("swap-test", TernaryCompressor, overwrite=True)
    first = make_compressor("swap-test", seed=7, clip_sigma=1.5)
    assert isinstance(first, TernaryCompressor) and first.seed == 7 and first.clip_sigma == 1.5
    register_compressor("swap-test", _HalfCompressor, overwrite=True)  # not ternary now
    assert isinstance(make_compressor("swap-test", seed=7, clip_sigma=1.5), _HalfCompressor)
    register_compressor("swap-test", TernaryCompressor, overwrite=True)
    again = make_compressor("swap-test", seed=8, clip_sigma=2.0)
    assert isinstance(again, TernaryCompressor) and again.seed == 8
