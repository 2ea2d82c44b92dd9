"""Broadcast formats: re-encoded updates and the shared-scale ternary sum."""

from __future__ import annotations

import math

import pytest
import torch

from fedddl.compression import IdentityCompressor, PayloadError, TernaryCompressor
from fedddl.compression.codecs.downlink import (
    decode_broadcast,
    encode_reencoded,
    encode_shared_sum,
    shared_sum_bits,
    ternary_codes,
)


@pytest.mark.parametrize(("n", "bits"), [(1, 2), (2, 3), (3, 3), (4, 4), (10, 5), (100, 8)])
def test_shared_sum_bits(n: int, bits: int) -> None:
    assert shared_sum_bits(n) == bits == math.ceil(math.log2(2 * n + 1))


def _client_payloads(n: int, scale: float) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        comp = TernaryCompressor(seed=i, clip_sigma=None)
        decoded = {}
        for name, shape in (("w", (7, 5)), ("b", (3,))):
            g = (torch.rand(shape, generator=gen) * 2 - 1) * scale
            payload, ctx = comp.compress(g, scale=scale)
            decoded[name] = comp.decompress(payload, ctx)
        out.append(decoded)
    return out


def test_shared_sum_decodes_to_the_exact_mean_of_client_gradients() -> None:
    n, scale = 10, 0.37
    clients = _client_payloads(n, scale)
    sums = {}
    for name in ("w", "b"):
        codes = [ternary_codes(c[name], scale) for c in clients]
        assert all(c is not None for c in codes)
        sums[name] = torch.stack([c for c in codes if c is not None]).sum(0).to(torch.int32)
    data = encode_shared_sum(sums, {"w": scale, "b": scale}, {"w": (7, 5), "b": (3,)}, n)
    decoded = decode_broadcast(data)
    for name in ("w", "b"):
        mean = torch.stack([c[name] for c in clients]).mean(0)
        assert decoded[name].shape == mean.shape
        torch.testing.assert_close(decoded[name], mean, rtol=0, atol=1e-6)
    # 1 tag + u16 + u32 + headers + data (ceil(35*5/8) + ceil(3*5/8)) + crc
    assert len(data) == 7 + (2 + 1 + 1 + 8 + 5) + (2 + 1 + 1 + 4 + 5) + 22 + 2 + 4


def test_shared_sum_rejects_out_of_range_and_corruption() -> None:
    with pytest.raises(ValueError, match="outside"):
        encode_shared_sum({"w": torch.tensor([3])}, {"w": 1.0}, {"w": (1,)}, 2)
    data = encode_shared_sum({"w": torch.tensor([1, -2, 0])}, {"w": 0.5}, {"w": (3,)}, 2)
    assert decode_broadcast(data)["w"].tolist() == [0.25, -0.5, 0.0]
    flipped = bytearray(data)
    flipped[-6] ^= 0xFF
    with pytest.raises(PayloadError, match="CRC"):
        decode_broadcast(bytes(flipped))
    with pytest.raises(PayloadError, match="truncated"):
        decode_broadcast(data[:5])
    with pytest.raises(PayloadError, match="unknown tag"):
        decode_broadcast(b"Z" + data[1:])
    with pytest.raises(PayloadError, match="empty"):
        decode_broadcast(b"")


def test_ternary_codes_detects_non_ternary_values() -> None:
    assert ternary_codes(torch.tensor([0.5, -0.5, 0.0]), 0.5) is not None
    assert ternary_codes(torch.tensor([0.5, 0.25]), 0.5) is None
    assert ternary_codes(torch.tensor([0.5]), 0.0) is None


def test_reencoded_identity_is_lossless_and_tagged() -> None:
    agg = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    data = encode_reencoded(agg, IdentityCompressor(), None)
    assert data[:1] == b"E"
    out = decode_broadcast(data)
    for k in agg:
        assert torch.equal(out[k], agg[k])
    with pytest.raises(PayloadError):
        decode_broadcast(data[:-1])


def test_add_statistics_extends_a_bundle_instead_of_nesting_it() -> None:
    from fedddl.compression.codecs.downlink import (
        add_statistics,
        decode_broadcast_parts,
        encode_bundle,
    )

    exact = encode_shared_sum({"w": torch.tensor([1, -2, 0])}, {"w": 0.5}, {"w": (3,)}, 2)
    bundle = encode_bundle(exact, dense={"b": torch.tensor([0.25])})
    stats = {"bn.mean": torch.tensor([1.0, 2.0])}
    both = add_statistics(bundle, stats)
    update, statistics = decode_broadcast_parts(both)
    assert torch.equal(update["w"], torch.tensor([0.25, -0.5, 0.0]))
    assert torch.equal(update["b"], torch.tensor([0.25]))
    assert torch.equal(statistics["bn.mean"], stats["bn.mean"])
    assert add_statistics(bundle, None) is bundle and add_statistics(bundle, {}) is bundle
    with pytest.raises(ValueError, match="already carries statistics"):
        add_statistics(both, stats)
