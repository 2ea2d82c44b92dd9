"""``quinary-projected-base5``: five-level codes packed 3 per 7 bits, projection scale."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from fedddl.compression import (
    PayloadError,
    QuinaryProjectedCompressor,
    TernaryPayload,
    decode_update,
    encode_update,
    make_compressor,
    open_message,
)
from fedddl.compression.algorithms.ternary_projected import PROJECTION_CAP
from fedddl.compression.backends.base5 import (
    invalid_base5,
    pack_base5,
    packed_size_base5,
    unpack_base5,
)
from fedddl.compression.backends.packing import find_invalid_codes, packed_size
from fedddl.compression.backends.unpacking import unpack_codes
from fedddl.compression.codecs.wire.opened import decode_small_batch
from tests.support.tensors import heavy_tailed

QUINARY = "quinary-projected-base5"


def _levels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-2, 3, n).astype(np.int8)


@pytest.mark.parametrize("n", [*range(0, 52), 1_000, 100_003])
def test_pack_and_unpack_round_trip_at_every_length(n: int) -> None:
    levels = _levels(n, n)
    packed = pack_base5(levels)
    assert packed.size == packed_size_base5(n) == packed_size(n, "base5") == -(-7 * -(-n // 3) // 8)
    assert invalid_base5(packed, n) is None
    out = np.full(n, np.nan, dtype=np.float32)
    unpack_base5(packed, n, 0.25, out)
    assert np.array_equal(out, levels.astype(np.float32) * np.float32(0.25))
    threaded = unpack_codes(torch.from_numpy(packed), n, 0.25, "base5")  # the batch path
    assert torch.equal(threaded, torch.from_numpy(out))


def test_seven_bits_per_three_values() -> None:
    assert packed_size_base5(3_000_000) * 8 / 3_000_000 == pytest.approx(7 / 3, rel=1e-6)


def test_invalid_bytes_are_named() -> None:
    packed = pack_base5(_levels(8, 0))  # 3 groups, 21 bits in 3 bytes: 3 spare bits
    assert find_invalid_codes(torch.from_numpy(packed[:-1].copy()), 8, "base5") is not None
    over = packed.copy()
    over[0] |= 0x7F  # group 0 = 127
    assert invalid_base5(over, 8) == "invalid base-5 group (> 124)"
    bits = 25 << 14  # group 2 (bits 14-20) = 25: code 1 in its third slot, value 9 of 8
    slot = np.array([bits & 0xFF, bits >> 8 & 0xFF, bits >> 16 & 0xFF], dtype=np.uint8)
    assert invalid_base5(slot, 8) == "non-zero padding in the last code group"
    spare = packed.copy()
    spare[-1] |= 0x80
    assert invalid_base5(spare, 8) == "non-zero padding in the last code byte"


def test_a_tampered_message_is_refused_whole_and_writes_nothing() -> None:
    g = {"a": torch.randn(300), "b": torch.randn(31)}
    data = bytearray(encode_update(g, QuinaryProjectedCompressor()))
    opened = open_message(bytes(data))
    assert [entry.codec for entry in opened.entries] == ["base5", "base5"]
    data[-5] |= 0x80  # the last byte of "b"'s codes: spare bits (31 values, 11 groups)
    data[-4:] = zlib.crc32(bytes(data[:-4])).to_bytes(4, "little")
    out = {name: torch.full_like(t, 7.0) for name, t in g.items()}
    with pytest.raises(PayloadError, match=r"'b'.*padding"):
        decode_update(bytes(data), out=out)
    assert all(bool((t == 7.0).all()) for t in out.values())


def test_the_decoded_update_keeps_its_length_along_the_input_at_half_the_error() -> None:
    g = torch.randn(20_011, generator=torch.Generator().manual_seed(1))
    decoded = decode_update(encode_update({"g": g}, QuinaryProjectedCompressor()))["g"].double()
    g64 = g.double()
    assert float(decoded @ g64) == pytest.approx(float(g64 @ g64), rel=1e-5)
    error = float((decoded - g64).norm() / g64.norm())
    assert 0.2 < error < 0.35  # ternary-projected-base3: about 0.6
    assert set(torch.unique(decoded / decoded.abs().max() * 2).tolist()) == {-2, -1, 0, 1, 2}


def test_contractive_on_heavy_tails_and_the_cap_binds() -> None:
    for seed in range(3):
        g = heavy_tailed(5_000, seed)
        out = decode_update(encode_update({"g": g}, QuinaryProjectedCompressor()))["g"]
        assert float((out - g).norm()) < float(g.norm())
    g = torch.ones(1_000)
    g[0] = 20.0  # with wide levels only g[0] gets one (2); the rest holds most of the energy
    out = decode_update(encode_update({"g": g}, QuinaryProjectedCompressor(step=10.0)))["g"]
    least_squares = 20.0 * 2 / 4  # <c, g> / ||c||^2; the projection scale would be 35
    assert float(out[0]) == pytest.approx(2 * PROJECTION_CAP * least_squares, rel=1e-6)
    assert int((out != 0).sum()) == 1
    assert float((out - g).norm()) < float(g.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_every_dtype_round_trips_in_its_own_dtype(dtype: torch.dtype) -> None:
    g = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)).to(dtype)
    compressor = QuinaryProjectedCompressor()
    payload, ctx = compressor.compress(g)
    assert isinstance(payload, TernaryPayload) and payload.codec == "base5"
    decoded = decode_update(encode_update({"g": g}, compressor))["g"]
    assert decoded.dtype == dtype and decoded.shape == g.shape
    torch.testing.assert_close(decoded, compressor.decompress(payload, ctx))
    into = {"g": torch.empty(4, 50, dtype=torch.float64)}
    decode_update(encode_update({"g": g}, compressor), out=into)
    torch.testing.assert_close(into["g"], decoded.double())


def test_zeros_small_tensors_and_bad_input() -> None:
    zero, _ = QuinaryProjectedCompressor().compress(torch.zeros(10))
    assert isinstance(zero, TernaryPayload) and zero.scale == 0.0
    dense, _ = QuinaryProjectedCompressor(min_numel=16).compress(torch.ones(15))
    assert not isinstance(dense, TernaryPayload)
    with pytest.raises(ValueError, match="NaN or Inf"):
        QuinaryProjectedCompressor().compress(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="no shared scale"):
        QuinaryProjectedCompressor().compress(torch.ones(3), scale=1.0)
    with pytest.raises(ValueError, match="step"):
        QuinaryProjectedCompressor(step=0.0)
    with pytest.raises(ValueError, match="scale_bucket"):
        make_compressor(QUINARY, seed=0, clip_sigma=2.5, scale_bucket=64)
    with pytest.raises(ValueError, match="one scale per tensor"):
        TernaryPayload(torch.zeros(1, dtype=torch.uint8), 0.0, 3, "base5", 2,
                       torch.zeros(2))  # fmt: skip


def test_bytes_and_the_batched_decode_of_many_messages() -> None:
    model = {"conv": torch.randn(6, 3, 5, 5), "fc": torch.randn(84, 120), "bias": torch.randn(84)}
    fp32 = sum(t.numel() * 4 for t in model.values())
    compressor = make_compressor(QUINARY, seed=0, clip_sigma=2.5)
    messages = [encode_update({n: t + k for n, t in model.items()}, compressor) for k in range(3)]
    assert fp32 / len(messages[0]) > 13.0
    opened = [open_message(m) for m in messages]
    batch = decode_small_batch(opened, model)
    assert batch is not None
    for decoded, message in zip(batch, messages, strict=True):
        single = decode_update(message)
        assert all(torch.equal(decoded[n], single[n]) for n in model)


def test_the_payload_attacks_forge_five_level_replies_in_their_own_codec() -> None:
    from fedddl.attacks.adaptive import adaptive_payload
    from fedddl.attacks.spec import parse_attack
    from fedddl.attacks.tamper import rewrite_payload

    g = {"w": torch.randn(40, 25, generator=torch.Generator().manual_seed(3))}
    honest_bytes = encode_update(g, QuinaryProjectedCompressor())
    honest = decode_update(honest_bytes)["w"]
    for spec, expected in [("scale:10", 10 * honest), ("sign-flip", -honest)]:
        attack = parse_attack(spec)
        assert attack is not None
        forged = rewrite_payload(honest_bytes, attack)
        assert [e.codec for e in open_message(forged).entries] == ["base5"]
        torch.testing.assert_close(decode_update(forged)["w"], expected)
    doubled = decode_update(adaptive_payload(honest_bytes, 2.0, 0.0))["w"]
    torch.testing.assert_close(doubled, 2 * honest)


def test_a_scale_whose_level_two_overflows_float32_is_refused() -> None:
    from fedddl.compression.backends.base5 import MAX_BASE5_SCALE

    data = bytearray(encode_update({"w": torch.randn(30)}, QuinaryProjectedCompressor()))
    scale_at = data.index(np.float32(open_message(bytes(data)).entries[0].scale).tobytes())
    data[scale_at : scale_at + 4] = np.float32(3e38).tobytes()
    data[-4:] = zlib.crc32(bytes(data[:-4])).to_bytes(4, "little")
    with pytest.raises(PayloadError, match="level 2 past float32"):
        decode_update(bytes(data))
    at_bound = float(np.float32(MAX_BASE5_SCALE))
    data[scale_at : scale_at + 4] = np.float32(at_bound).tobytes()
    data[-4:] = zlib.crc32(bytes(data[:-4])).to_bytes(4, "little")
    assert bool(torch.isfinite(decode_update(bytes(data))["w"]).all())
    with pytest.raises(ValueError, match="level 2"):
        TernaryPayload(torch.zeros(1, dtype=torch.uint8), float(np.float32(3e38)), 3, "base5")


def test_the_bench_stand_ins_decode_what_they_stand_for() -> None:
    from fedddl.compression.algorithms.ternary_projected import ProjectedTernaryCompressor
    from simulations.quinary_standins import StandIn

    g = heavy_tailed(3_000, 4).reshape(30, 100)
    library = decode_update(encode_update({"g": g}, QuinaryProjectedCompressor()))["g"]
    assert torch.equal(StandIn("quinary-projected").quantize(g), library)
    ls = StandIn("quinary-ls").quantize(g).double()
    assert float((ls - g.double()).norm()) <= float((library.double() - g.double()).norm())
    once = decode_update(encode_update({"g": g}, ProjectedTernaryCompressor()))["g"]
    twice = StandIn("ternary-twice").quantize(g)
    assert float((twice - g).norm()) < float((once - g).norm())
    with pytest.raises(ValueError, match="unknown stand-in"):
        StandIn("sign")


def test_screened_as_five_level_codes_only() -> None:
    from fedddl.compression.algorithms.ternary_projected import ProjectedTernaryCompressor
    from fedddl.sync.errors import PayloadRejected
    from fedddl.sync.screening import PayloadSpec

    compressor = QuinaryProjectedCompressor()
    spec = PayloadSpec.for_shapes({"w": (500,)}, compressor)
    assert spec.ternary_codecs == frozenset({"base5"})
    g = {"w": heavy_tailed(500, 5)}
    decoded = spec.check(encode_update(g, compressor), 0).decode()
    assert torch.equal(decoded["w"], decode_update(encode_update(g, compressor))["w"])
    with pytest.raises(PayloadRejected, match="codec 'base3'"):
        spec.check(encode_update(g, ProjectedTernaryCompressor()), 0)


def test_decoding_and_checks_span_many_chunks_and_levels_out_of_range_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedddl.compression.backends import base5

    monkeypatch.setattr(base5, "_CHUNK_BLOCKS", 2)  # 48 values a chunk
    levels = _levels(1_000, 7)
    packed = pack_base5(levels)
    assert invalid_base5(packed, 1_000) is None
    out = np.empty(1_000, dtype=np.float32)
    unpack_base5(packed, 1_000, 1.0, out)  # decoded in the same chunks
    assert np.array_equal(out, levels.astype(np.float32))
    bad = packed.copy()
    bad[-20] |= 0xFF  # a group in a late chunk reads 127
    assert invalid_base5(bad, 1_000) == "invalid base-5 group (> 124)"
    with pytest.raises(ValueError, match=r"levels must be in \[-2, 2\]"):
        pack_base5(np.array([0, 3], dtype=np.int8))
