"""compress_batch: one threaded pass over many tensors, bit-identical to one at a time."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from fedddl.compression import (
    Compressor,
    TernaryCompressor,
    TernaryPayload,
    decode_update,
    encode_update,
)
from fedddl.compression.algorithms.payload import Context, Payload
from fedddl.compression.backends.ternarize import CHUNK


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(64, 3, 3, 3, generator=generator),
        torch.randn(5, generator=generator),  # below min_numel: dense
        torch.zeros(0, 3),  # empty
        torch.zeros(40),  # all zero: scale 0, no random values used
        torch.randn(2 * CHUNK + 13, generator=generator),  # several chunks, odd length
        torch.randn(33, 7, generator=generator).half(),
        torch.randn(1, generator=generator),  # not a multiple of 4: the stream rounds up
        torch.randn(CHUNK - 3, generator=generator).double(),
    ]


def _same(first: tuple[Payload, Context], second: tuple[Payload, Context]) -> None:
    (a, a_ctx), (b, b_ctx) = first, second
    assert a_ctx == b_ctx and type(a) is type(b)
    if isinstance(a, TernaryPayload):
        assert isinstance(b, TernaryPayload)
        assert (a.scale, a.numel, a.codec) == (b.scale, b.numel, b.codec)
        assert torch.equal(a.codes, b.codes)
    else:
        assert torch.equal(a.values, b.values)  # type: ignore[union-attr]


@pytest.mark.parametrize("codec", ["2bit", "base3"])
@pytest.mark.parametrize("clip_sigma", [2.5, None])
def test_batch_equals_one_at_a_time_and_leaves_the_stream_in_the_same_place(
    threads: int, codec: str, clip_sigma: float | None
) -> None:
    tensors = _tensors()
    options = {"seed": 3, "min_numel": 8, "codec": codec, "clip_sigma": clip_sigma}
    batched, single = TernaryCompressor(**options), TernaryCompressor(**options)  # type: ignore[arg-type]
    results = batched.compress_batch(tensors)
    for tensor, result in zip(tensors, results, strict=True):
        _same(result, single.compress(tensor))
    probe = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    _same(batched.compress(probe), single.compress(probe))


def test_shared_scales_and_deterministic_mode_match_one_at_a_time(threads: int) -> None:
    tensors = [t for t in _tensors() if t.numel() >= 8]
    single = TernaryCompressor(seed=1)
    scales = [2 * single.local_scale(t) if t.numel() else None for t in tensors]  # type: ignore[operator]
    expected = [single.compress(t, scale=s) for t, s in zip(tensors, scales, strict=True)]
    batch = TernaryCompressor(seed=1).compress_batch(tensors, scales)
    for result, reference in zip(batch, expected, strict=True):
        _same(result, reference)
    deterministic = TernaryCompressor(deterministic=True, threshold=0.3)
    for tensor, result in zip(tensors, deterministic.compress_batch(tensors), strict=True):
        _same(result, deterministic.compress(tensor))


def test_an_error_names_the_tensor_and_does_not_move_the_stream() -> None:
    tensors = _tensors()
    tensors[4] = tensors[4].clone()
    tensors[4][CHUNK + 1] = float("nan")
    compressor = TernaryCompressor(seed=9)
    with pytest.raises(ValueError, match=r"^tensor 4: .*NaN"):
        compressor.compress_batch(tensors)
    with pytest.raises(ValueError, match=r"^tensor 0: shared scale"):
        compressor.compress_batch(tensors[:1], [1e-9])
    with pytest.raises(ValueError, match="2 scales for 1 tensors"):
        compressor.compress_batch(tensors[:1], [None, None])
    probe = torch.randn(100, generator=torch.Generator().manual_seed(1))
    _same(compressor.compress(probe), TernaryCompressor(seed=9).compress(probe))


class _OneAtATime(TernaryCompressor):
    """The base class's compress_batch: compress() on each tensor in order."""

    def compress_batch(
        self, tensors: Sequence[torch.Tensor], scales: Sequence[float | None] | None = None
    ) -> list[tuple[Payload, Context]]:
        return Compressor.compress_batch(self, tensors, scales)


def test_encode_update_is_byte_identical_to_the_one_at_a_time_path(threads: int) -> None:
    named = {f"t{i}": t for i, t in enumerate(_tensors())}
    data = encode_update(named, TernaryCompressor(seed=4, min_numel=8))
    assert data == encode_update(named, _OneAtATime(seed=4, min_numel=8))
    assert list(decode_update(data)) == list(named)


def test_encode_update_names_the_bad_tensor() -> None:
    named = {f"t{i}": t for i, t in enumerate(_tensors())}
    named["t6"] = torch.tensor([float("inf")])
    with pytest.raises(ValueError, match=r"^tensor 't6': .*NaN or Inf"):
        encode_update(named, TernaryCompressor())
