"""The torch kernels of the device path against the numpy path, byte for byte, on CPU
tensors; and on the ``meta`` device, where a host tensor or a host synchronisation
inside a kernel raises (:class:`tests.support.device_guard.DeviceGuard`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedddl.compression.backends import device_kernels as kernels
from fedddl.compression.backends.packing import pack_codes, packed_size
from fedddl.compression.backends.ternarize import (
    CHUNK as CPU_CHUNK,
)
from fedddl.compression.backends.ternarize import (
    RandomBits,
    ternarize_deterministic,
    ternarize_stochastic,
)
from fedddl.compression.backends.unpacking import unpack_codes
from tests.support.device_guard import DeviceGuard, DeviceMixingError
from tests.support.reference import python_pack

CODECS = ["2bit", "base3"]
# lengths around every remainder mod 4 and 5, empty, and past a few whole groups
LENGTHS = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 19, 20, 21, 257, 1001]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _codes(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + numel)
    return torch.randint(0, 3, (numel,), dtype=torch.uint8, generator=generator)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that -0.0 and 0.0 compare unequal."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(width[tensor.element_size()])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", LENGTHS)
def test_packing_equals_the_numpy_packing_byte_for_byte(codec: str, numel: int) -> None:
    codes = _codes(numel)
    packed = kernels.pack_codes(codes, codec)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_size(numel, codec)
    assert torch.equal(packed, pack_codes(codes, codec))
    signs = [(0, 1, -1)[code] for code in codes.tolist()]
    assert bytes(packed.numpy()) == python_pack(signs, codec)


@pytest.mark.parametrize("codec", CODECS)
def test_every_group_of_codes_packs_as_on_the_cpu(codec: str) -> None:
    per = 4 if codec == "2bit" else 5
    groups = torch.tensor(list(itertools.product(range(3), repeat=per)), dtype=torch.uint8)
    codes = groups.flip(1).reshape(-1)  # 3**per groups: every valid byte once
    packed = kernels.pack_codes(codes, codec)
    assert torch.equal(packed, pack_codes(codes, codec))
    assert len(set(packed.tolist())) == 3**per


def test_packing_into_a_slot_writes_only_the_slot() -> None:
    buffer = torch.full((10,), 0xAA, dtype=torch.uint8)
    codes = _codes(13)
    kernels.pack_codes(codes, "base3", buffer[3:6])
    assert torch.equal(buffer[3:6], pack_codes(codes, "base3"))
    assert bool((buffer[:3] == 0xAA).all()) and bool((buffer[6:] == 0xAA).all())
    with pytest.raises(ValueError, match="bytes"):
        kernels.pack_codes(codes, "base3", buffer[:2])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", [0, 1, 3, 4, 5, 6, 21, 1001])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unpacking_round_trips_and_equals_the_numpy_decode_bit_for_bit(
    codec: str, numel: int, dtype: torch.dtype
) -> None:
    codes = _codes(numel, seed=1)
    packed = pack_codes(codes, codec)
    out = torch.full((numel,), float("nan"), dtype=dtype)
    kernels.unpack_codes(packed, numel, 0.375, codec, out)
    expected = unpack_codes(packed, numel, 0.375, codec).to(dtype)
    assert torch.equal(_bits(out), _bits(expected))
    signs = torch.tensor([(0.0, 1.0, -1.0)[c] for c in codes.tolist()], dtype=dtype)
    assert torch.equal(out, signs * 0.375)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("scale", [0.0, 1.0, 3.0e-5, 65504.0])
def test_every_byte_decodes_as_on_the_cpu_including_invalid_ones(codec: str, scale: float) -> None:
    per = 4 if codec == "2bit" else 5
    packed = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256 * per)
    kernels.unpack_codes(packed, 256 * per, scale, codec, out)
    # signed zeros included: -1 * 0.0 is -0.0 on both paths
    assert torch.equal(_bits(out), _bits(unpack_codes(packed, 256 * per, scale, codec)))


def test_unpacking_checks_sizes() -> None:
    with pytest.raises(ValueError, match="code bytes"):
        kernels.unpack_codes(torch.zeros(3, dtype=torch.uint8), 20, 1.0, "2bit", torch.empty(20))
    with pytest.raises(ValueError, match="outputs"):
        kernels.unpack_codes(torch.zeros(5, dtype=torch.uint8), 20, 1.0, "2bit", torch.empty(19))


@pytest.mark.parametrize("numel", [1, 7, 1000, 4099])
def test_statistics_peak_is_exact_and_std_is_float64_accurate(
    numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "CHUNK", 20 * 7)  # several chunks: checks the combination
    generator = torch.Generator().manual_seed(numel)
    # a large mean next to a small spread: E[g^2] - mean^2 would cancel catastrophically
    flat = 1000.0 + torch.randn(numel, generator=generator) * 1e-3
    peak, std = kernels.statistics(flat).tolist()
    values = flat.double().numpy()
    assert peak == float(np.abs(values).max())
    assert std == pytest.approx(float(np.std(values)), rel=1e-9, abs=1e-12)
    without = kernels.statistics(flat, with_std=False).tolist()
    assert without[0] == peak and np.isnan(without[1])


def test_statistics_do_not_overflow_where_float32_squares_would() -> None:
    flat = torch.tensor([3.0e30, -3.0e30, 1.0e30, 0.0])
    peak, std = kernels.statistics(flat).tolist()
    assert peak == pytest.approx(3.0e30)
    assert std == pytest.approx(float(np.std(flat.double().numpy())), rel=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_statistics_flag_non_finite_values_through_the_peak(bad: float) -> None:
    flat = torch.tensor([1.0, bad, -2.0])
    assert not np.isfinite(kernels.statistics(flat).tolist()[0])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("clip", [None, 0.7])
def test_the_stochastic_rule_fed_the_cpu_random_stream_gives_the_cpu_codes(
    codec: str, clip: float | None
) -> None:
    """Only the random source differs between the paths: with the CPU path's own 16-bit
    integers the torch rule (float32 level, clip, compare) gives its exact bytes, across
    a CPU chunk boundary and with a partial last byte."""
    numel = CPU_CHUNK + 1003
    generator = torch.Generator().manual_seed(5)
    flat = torch.randn(numel, generator=generator)
    flat[:50] = 0.0  # zeros never fire
    flat[50] = -0.0
    scale = float(np.float32(flat.abs().max()))
    expected = ternarize_stochastic(flat, scale, clip, RandomBits(7), codec)
    words = -(-numel // 4)
    stream = np.random.PCG64DXSM(7).random_raw(words).view(np.uint16)[:numel]
    random = torch.from_numpy(stream.astype(np.int32))
    factor = float(np.float32(kernels.RANDOM_HIGH / scale))
    limit = None if clip is None else float(np.float32(clip * factor))
    codes = kernels.stochastic_codes(flat, factor, limit, random)
    assert torch.equal(kernels.pack_codes(codes, codec), expected)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(("clip", "threshold"), [(None, 0.5), (1.2, 0.3), (0.2, 0.5)])
def test_the_deterministic_kernel_gives_the_cpu_bytes(
    codec: str, clip: float | None, threshold: float
) -> None:
    flat = torch.randn(CPU_CHUNK + 17, generator=torch.Generator().manual_seed(2))
    scale = float(np.float32(flat.abs().max()))
    out = torch.full((packed_size(flat.numel(), codec),), 0xAA, dtype=torch.uint8)
    kernels.ternarize_deterministic(flat, scale, clip, threshold, codec, out)
    assert torch.equal(out, ternarize_deterministic(flat, scale, clip, threshold, codec))


@pytest.mark.parametrize("codec", CODECS)
def test_stochastic_chunks_draw_in_order_and_land_in_their_bytes(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "CHUNK", 20 * 3)
    flat = torch.randn(203, generator=torch.Generator().manual_seed(4))
    out = torch.empty(packed_size(203, codec), dtype=torch.uint8)
    kernels.ternarize_stochastic(flat, 3.0, None, torch.Generator().manual_seed(9), codec, out)
    generator = torch.Generator().manual_seed(9)  # the same draws, one per chunk, by hand
    factor = float(np.float32(kernels.RANDOM_HIGH / 3.0))
    codes = [
        kernels.stochastic_codes(
            chunk, factor, None, kernels.random_levels(chunk.numel(), generator, flat.device)
        )
        for chunk in flat.split(60)
    ]
    assert torch.equal(out, pack_codes(torch.cat(codes), codec))


def test_random_levels_are_16_bit_integers() -> None:
    levels = kernels.random_levels(1 << 16, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert levels.dtype == torch.int32
    assert int(levels.min()) >= 0 and int(levels.max()) == kernels.RANDOM_HIGH - 1


# ------------------------------------------------------------------------------ meta device
def test_the_guard_catches_what_meta_alone_does_not() -> None:
    table, index = torch.ones(256, 4), torch.zeros(3, dtype=torch.int32, device="meta")
    with pytest.raises(DeviceMixingError, match="index_select"), DeviceGuard():
        torch.index_select(table, 0, index)  # runs on the CPU without the guard
    with pytest.raises(DeviceMixingError, match="cpu"), DeviceGuard(only="meta"):
        torch.zeros(3)


@pytest.mark.parametrize("codec", CODECS)
def test_every_kernel_runs_on_meta_without_touching_the_host(codec: str) -> None:
    """On ``meta`` a kernel that created a host tensor, mixed devices or synchronised
    (``.item()``, ``bool(t)``, ``.cpu()`` all raise on meta) would fail here."""
    meta = torch.device("meta")
    numel = 1003
    flat = torch.empty(numel, device=meta)
    packed = torch.empty(packed_size(numel, codec), dtype=torch.uint8, device=meta)
    with DeviceGuard(only=meta):
        stats = kernels.statistics(flat)
        assert stats.device == meta and stats.shape == (2,)
        assert kernels.statistics(flat, with_std=False).device == meta
        random = kernels.random_levels(numel, None, meta)
        codes = kernels.stochastic_codes(flat, 2.0, 1.5, random)
        assert codes.device == meta and codes.dtype == torch.uint8
        assert kernels.threshold_codes(flat, 0.5).device == meta
        assert kernels.pack_codes(codes, codec).device == meta
        kernels.ternarize_stochastic(flat, 1.0, 0.5, None, codec, packed)
        kernels.ternarize_deterministic(flat, 1.0, None, 0.5, codec, packed)
        for dtype in DTYPES:
            out = torch.empty(numel, dtype=dtype, device=meta)
            kernels.unpack_codes(packed, numel, 0.25, codec, out)
        table = kernels.value_table(codec, 0.25, torch.float16, meta)
        assert table.device == meta and table.dtype == torch.float16
