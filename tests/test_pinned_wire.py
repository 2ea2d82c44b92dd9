"""Pinned wire bytes of the uplink encoder on inputs every machine computes exactly.

The gradients are multiples of ``2**-20`` with a peak of exactly 1 (so the scale, every
``|g| * 2**16 / s - 1/2`` and every error-feedback residual are exact in float32; the second
round's scale is not a power of two, and IEEE rounding makes its products the same
everywhere), and no tensor comes near the clip bound, so the ternary codes depend only on the seeded
random stream. The SHA-256 of each message is therefore the same on every CPU, torch
build and back end (numba kernels or numpy, any thread count).

Regenerate (only for a deliberate change of the codes or the format, and say so in the
commit): ``python -m tests.test_pinned_wire`` prints the digests.
"""

from __future__ import annotations

import hashlib

import torch

from fedddl.compression import ResidualMemory, decode_update, encode_update, make_compressor

# About 8 of these 2**20 values fire differently if the probability's rounding moves by
# half a step (2**-17): enough for the digests to see it.
_BIG = 1 << 20

PINNED = {
    ("ternary-base3", 0): "51d8644c7abd6a6ed901b767502220ce8e7254e82cbf490bd374bd69a3f77cd9",
    ("ternary-base3", 1): "b47f816ef7ff7cce318eea63aa59c27899c7b553d3077f4adead52203ad8484a",
    ("ternary", 0): "244b82ab8eb357b9cde9460d986be77e729bc5626311fc346acb6778b481f45f",
    ("ternary", 1): "45c8461cc37b29df2770d9ee9c4dad1fc4faeedd1325fed1e4aae018aa61c805",
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


def messages(name: str) -> list[bytes]:
    """Two rounds of messages with error feedback (the second compensates the first)."""
    compressor = make_compressor(name, seed=7, clip_sigma=10.0)  # 10 sigma: never clips
    memory = ResidualMemory()
    grads = gradients()
    return [encode_update(grads, compressor, memory, dense=("fc.bias",)) for _ in range(2)]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_messages_match_pinned_digests() -> None:
    for name in ("ternary-base3", "ternary"):
        for step, data in enumerate(messages(name)):
            assert _digest(data) == PINNED[(name, step)], f"{name} message {step}"


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
    for name in ("ternary-base3", "ternary"):
        for step, data in enumerate(messages(name)):
            print(f'    ("{name}", {step}): "{_digest(data)}",')
