"""The compiled kernels (numba) against the numpy code: bit-identical results.

Whether numba is installed, or used, must never change a message or a decoded value.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fedddl.compression import (
    TernaryCompressor,
    TernaryEntropyCompressor,
    decode_update,
    encode_update,
)
from fedddl.compression.backends import jit
from fedddl.compression.backends.ternarize import CHUNK, RandomBits, ternarize_stochastic_batch
from fedddl.compression.backends.unpacking import unpack_codes_batch, unpack_codes_new

pytestmark = pytest.mark.skipif(not jit.available(), reason="numba is not installed")


@pytest.fixture()
def restore_jit() -> Iterator[None]:
    yield
    jit.set_jit(None)


def _kernels() -> object:
    module = jit.jit_kernels(1 << 30)
    assert module is not None
    return module


@pytest.mark.parametrize("seed", [0, 1, 2**63 + 5])
@pytest.mark.parametrize("offset", [0, 4, 4 * 12345])
def test_pcg_kernel_is_numpys_pcg64dxsm(seed: int, offset: int) -> None:
    bits = RandomBits(seed)
    state = bits.state_at(offset)
    out = np.empty(1001, dtype=np.uint64)
    _kernels().pcg64dxsm_words(state, out)  # type: ignore[attr-defined]
    expected_generator = bits.fork(offset)
    np.testing.assert_array_equal(out, expected_generator.random_raw(1001))
    # the state was advanced past the words drawn
    again = np.empty(3, dtype=np.uint64)
    _kernels().pcg64dxsm_words(state, again)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(again, expected_generator.random_raw(3))


def _batch(rng: np.random.Generator) -> list[torch.Tensor]:
    sizes = [1, 3, 19, 20, 21, 4001, CHUNK, CHUNK + 1, 2 * CHUNK + 13, 7]
    arrays = [rng.standard_normal(n).astype(np.float32) * rng.uniform(1e-3, 1e3) for n in sizes]
    arrays[2][:5] = [0.0, -0.0, 1e-30, -1e-30, 0.0]  # zeros of both signs, denormal-ish
    return [torch.from_numpy(a) for a in arrays]


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_ternarize_kernel_matches_numpy(threads: int, codec: str, restore_jit: None) -> None:
    flats = _batch(np.random.default_rng(threads))
    peaks = [float(np.float32(f.abs().max())) for f in flats]
    # no clipping, a clip bound well inside (values overflow to the limit), a shared scale
    scales = [p if k % 3 else 2 * p for k, p in enumerate(peaks)]
    bounds = [None if k % 2 else p * 1e-3 for k, p in enumerate(peaks)]
    results = {}
    for mode in (False, True):
        jit.set_jit(mode)
        bits = RandomBits(11)
        bits.skip(8)
        packed = ternarize_stochastic_batch(flats, scales, bounds, bits, codec)
        results[mode] = ([p.numpy().copy() for p in packed], bits.fork(0).random_raw(2))
    for ours, numpys in zip(results[True][0], results[False][0], strict=True):
        np.testing.assert_array_equal(ours, numpys)
    np.testing.assert_array_equal(results[True][1], results[False][1])  # same stream position


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_unpack_kernel_matches_numpy(threads: int, codec: str, restore_jit: None) -> None:
    del threads
    rng = np.random.default_rng(3)
    per = 4 if codec == "2bit" else 5
    items = []
    for numel in (1, 9, 5 * 4 * (1 << 16) + 3, 123457):
        packed = rng.integers(0, 256, -(-numel // per), dtype=np.uint8)  # invalid codes too
        items.append((torch.from_numpy(packed), numel, float(rng.uniform(0.1, 3)), codec))
    decoded = {}
    for mode in (False, True):
        jit.set_jit(mode)
        fresh = unpack_codes_new(items)
        buffers = [torch.full((numel,), 7.0) for _, numel, _, _ in items]
        unpack_codes_batch([(*item, buffer) for item, buffer in zip(items, buffers, strict=True)])
        decoded[mode] = (fresh, buffers)
    for ours, numpys in zip(decoded[True], decoded[False], strict=True):
        for a, b in zip(ours, numpys, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "compressor",
    [
        lambda: TernaryCompressor(seed=4),
        lambda: TernaryCompressor(seed=4, codec="base3", clip_sigma=None),
        lambda: TernaryEntropyCompressor(seed=4),
    ],
)
def test_messages_do_not_depend_on_the_kernels(compressor: object, restore_jit: None) -> None:
    generator = torch.Generator().manual_seed(0)
    update = {
        "conv": torch.randn(64, 32, 3, 3, generator=generator),
        "fc": torch.randn(3 * CHUNK + 11, generator=generator),
        "bias": torch.randn(10, generator=generator),
    }
    messages, decoded = {}, {}
    for mode in (False, True):
        jit.set_jit(mode)
        messages[mode] = encode_update(update, compressor())  # type: ignore[operator]
        decoded[mode] = decode_update(messages[mode])
    assert messages[True] == messages[False]
    for name in update:
        assert torch.equal(decoded[True][name], decoded[False][name])


def test_small_calls_stay_on_numpy(restore_jit: None) -> None:
    jit.set_jit(None)
    assert jit.jit_kernels(jit.MIN_NUMEL - 1) is None
    assert jit.jit_kernels(jit.MIN_NUMEL) is not None
    jit.set_jit(False)
    assert jit.jit_kernels(1 << 30) is None


def test_warm_up_compiles_the_kernels_in_this_process_and_keeps_the_mode() -> None:
    """What a fork server calls before forking, so its children inherit compiled kernels."""
    import subprocess
    import sys

    code = (
        "import fedddl.compression.backends.jit as jit\n"
        "from fedddl.compression.warmup import warm_up\n"
        "assert warm_up()\n"
        "from fedddl.compression.backends import kernels as k\n"
        "assert k.ternarize_pack.signatures and k.unpack_base3.signatures\n"
        "assert k.unpack_2bit.signatures and k.lane_statistics.signatures\n"
        "assert jit._mode is None\n"  # the default mode is restored
        "jit.set_jit(False)\n"
        "assert not warm_up()\n"  # FEDDDL_JIT=0 / set_jit(False): nothing is compiled
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_fork_server_preload_calls_module_functions() -> None:
    import pytest

    from fedddl.deploy.warm_clientapp import preload_modules

    preload_modules(["json", "fedddl.compression.backends.jit:available"])
    with pytest.raises(AttributeError):
        preload_modules(["fedddl.compression.backends.jit:no_such_function"])
    with pytest.raises(ImportError):
        preload_modules(["no_such_module_xyz"])


def _statistics_batch() -> list[torch.Tensor]:
    from fedddl.compression.backends.statistics import LANE_MIN_NUMEL

    rng = np.random.default_rng(5)
    sizes = [LANE_MIN_NUMEL, LANE_MIN_NUMEL + 7, 3 * (1 << 18) + 5, 100]
    scales = [1e-3, 1.0, 1e30, 2.0]  # squares of 1e30 overflow float32, not float64
    arrays = [
        (rng.standard_normal(n) * s + s / 3).astype(np.float32)
        for n, s in zip(sizes, scales, strict=True)
    ]
    arrays[1][-3:] = [3e38, -3e38, -0.0]  # the peak in the tail, beyond lane 0
    return [torch.from_numpy(a) for a in arrays]


def test_lane_statistics_kernel_matches_numpy_and_float64(threads: int, restore_jit: None) -> None:
    """Large tensors' sums in float64 lanes: the vector kernel, the numpy fallback and any
    number of threads give the same bits, close to an exact float64 reference."""
    from fedddl.compression.backends.statistics import tensor_statistics_batch

    flats = _statistics_batch()
    results = {}
    for mode in (False, True):
        jit.set_jit(mode)
        results[mode] = tensor_statistics_batch(flats)
    assert results[True] == results[False]
    torch.set_num_threads(1)  # the fixture restores the count
    assert tensor_statistics_batch(flats) == results[True]
    for flat, stats in zip(flats, results[True], strict=True):
        wide = flat.numpy().astype(np.float64)
        assert stats.peak == float(np.abs(wide).max())
        exact = 1e-9 if wide.size >= 1 << 16 else 1e-6  # small tensors: float32 einsum sums
        assert stats.std == pytest.approx(float(wide.std()), rel=exact)
        assert math.isfinite(stats.std)
    del threads


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", [False, True])
def test_lane_statistics_name_non_finite_values(bad: float, mode: bool, restore_jit: None) -> None:
    from fedddl.compression.backends.statistics import tensor_statistics_batch

    jit.set_jit(mode)
    flats = _statistics_batch()
    flats[2] = flats[2].clone()
    flats[2][(1 << 18) + 17] = bad  # in the second chunk
    with pytest.raises(ValueError, match=r"^t2: tensor has NaN or Inf values$"):
        tensor_statistics_batch(flats, labels=["t0", "t1", "t2", "t3"])
