"""Pinned wire bytes of the uplink encoder on inputs every machine computes exactly.

The gradients are multiples of ``2**-20`` with a peak of exactly 1 (so the scale, every
``|g| * 2**16 / s - 1/2`` and every error-feedback residual are exact in float32; the second
round's scale is not a power of two, and IEEE rounding makes its products the same
everywhere), and no tensor comes near the clip bound, so the ternary codes depend only on the seeded
random stream. The SHA-256 of each message is therefore the same on every CPU, torch
build and back end (numba kernels or numpy, any thread count).

Regenerate (only for a deliberate change of the codes or the format, and say so in the
commit): ``python -m tests.test_pinned_wire`` prints the digests.

Both message kinds are pinned: one scale per tensor (wire format version 1, the compressor's
own default and what ``scale-bucket = 0`` sends) and one scale per output channel (version 2,
``scale-bucket = -1``, the run config's choice where it applies). The row scales are maxima of
exact values and each ``g / s_b`` is one IEEE division, so the argument above holds for both.
"""

from __future__ import annotations

import hashlib

import torch

from fedddl.compression import (
    BUCKETS_VERSION,
    FORMAT_VERSION,
    ResidualMemory,
    decode_update,
    encode_update,
    make_compressor,
)
from fedddl.compression.algorithms.ternary_buckets import PER_CHANNEL

# About 8 of these 2**20 values fire differently if the probability's rounding moves by
# half a step (2**-17): enough for the digests to see it.
_BIG = 1 << 20

PINNED = {
    ("ternary-base3", 0): "51d8644c7abd6a6ed901b767502220ce8e7254e82cbf490bd374bd69a3f77cd9",
    ("ternary-base3", 1): "b47f816ef7ff7cce318eea63aa59c27899c7b553d3077f4adead52203ad8484a",
    ("ternary", 0): "244b82ab8eb357b9cde9460d986be77e729bc5626311fc346acb6778b481f45f",
    ("ternary", 1): "45c8461cc37b29df2770d9ee9c4dad1fc4faeedd1325fed1e4aae018aa61c805",
}

#: One scale per output channel (``scale_bucket=-1``): version-2 messages.
PINNED_PER_CHANNEL = {
    ("ternary-base3", 0): "1eb8311485f278b9d2234673c80a30d27374a8863e1c9706ecefc08713220496",
    ("ternary-base3", 1): "4fea82ef2024e922b50a41b3536d0aed516dd3261d6b63c7b367913843e330e9",
    ("ternary", 0): "3b1692e255dc75d5c551a6013a73544f5ec24f167265f90e36610ef3131e924a",
    ("ternary", 1): "2e2b6974dff0e90367a0e80e7391829749a2add55ca3b862dd49aa194914f77a",
}


def gradients() -> dict[str, torch.Tensor]:
    """Named tensors of exactly representable values (one dense bias, two ternarised)."""
    i = torch.arange(_BIG, dtype=torch.int64)
    k = (i * 2654435761 + 12345) % (2 * _BIG + 1) - _BIG  # integers in [-2**20, 2**20]
    weight = (k.to(torch.float64) / _BIG).to(torch.float32)
    weight[0] = 1.0  # the peak: the scale is exactly 1
    weight[1:64] = 0.0  # zeros never fire
    small = torch.arange(-7, 8, dtype=torch.float32).reshape(3, 5) / 16  # peak 7/16
    bias = torch.arange(10, dtype=torch.float32) / 8 - 0.5
    return {"fc.weight": weight.reshape(1024, 1024), "out.weight": small, "fc.bias": bias}


def messages(name: str, scale_bucket: int = 0) -> list[bytes]:
    """Two rounds of messages with error feedback (the second compensates the first)."""
    compressor = make_compressor(  # 10 sigma: never clips
        name, seed=7, clip_sigma=10.0, scale_bucket=scale_bucket
    )
    memory = ResidualMemory()
    grads = gradients()
    return [encode_update(grads, compressor, memory, dense=("fc.bias",)) for _ in range(2)]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_messages_match_pinned_digests() -> None:
    for name in ("ternary-base3", "ternary"):
        for step, data in enumerate(messages(name)):
            assert _digest(data) == PINNED[(name, step)], f"{name} message {step}"


def test_per_tensor_messages_are_version_1() -> None:
    for name in ("ternary-base3", "ternary"):
        assert {data[4] for data in messages(name)} == {FORMAT_VERSION}


def test_per_channel_messages_match_pinned_digests() -> None:
    for name in ("ternary-base3", "ternary"):
        for step, data in enumerate(messages(name, PER_CHANNEL)):
            assert data[4] == BUCKETS_VERSION, f"{name} message {step}"
            assert _digest(data) == PINNED_PER_CHANNEL[(name, step)], f"{name} message {step}"


def test_per_channel_messages_decode_to_row_scaled_signs() -> None:
    """Each row decodes to its own peak times a code; the bias (1-D) is exact."""
    grads = gradients()
    first = decode_update(messages("ternary-base3", PER_CHANNEL)[0])
    torch.testing.assert_close(first["fc.bias"], grads["fc.bias"], rtol=0, atol=0)
    for name in ("fc.weight", "out.weight"):
        g, d = grads[name], first[name]
        peaks = g.abs().amax(dim=1, keepdim=True)
        assert torch.all((d == 0) | (d.abs() == peaks.expand_as(d)))
        assert torch.all(d * g >= 0)
        assert torch.all(d[g.abs() == peaks.expand_as(g)] == g[g.abs() == peaks.expand_as(g)])


def test_messages_decode_to_scaled_signs() -> None:
    """Decoded values are ``scale * code`` with the gradient's sign; the bias is exact."""
    grads = gradients()
    first = decode_update(messages("ternary-base3")[0])
    assert list(first) == list(grads)
    torch.testing.assert_close(first["fc.bias"], grads["fc.bias"], rtol=0, atol=0)
    for name, peak in (("fc.weight", 1.0), ("out.weight", 7 / 16)):
        g, d = grads[name], first[name]
        assert set(d.unique().tolist()) <= {-peak, 0.0, peak}
        assert torch.all(d * g >= 0)
        assert torch.all(d[g == 0] == 0)
        assert torch.all(d[g.abs() == peak] == g[g.abs() == peak])
    fired = (first["fc.weight"] != 0).sum().item()
    expected = grads["fc.weight"].abs().sum().item()  # unbiased: E[fired] = sum |g| / s
    assert abs(fired - expected) < 5 * expected**0.5


if __name__ == "__main__":
    for scale_bucket, table in ((0, "PINNED"), (PER_CHANNEL, "PINNED_PER_CHANNEL")):
        print(f"{table} = {{")
        for name in ("ternary-base3", "ternary"):
            for step, data in enumerate(messages(name, scale_bucket)):
                print(f'    ("{name}", {step}): "{_digest(data)}",')
        print("}")
