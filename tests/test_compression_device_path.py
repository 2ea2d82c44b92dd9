"""The torch path of TernaryCompressor / encode_update / decode_update, run on CPU tensors
(``torch_path_on_cpu``) and on ``meta`` tensors, against the numpy path.

What is bit-identical between the paths: deterministic payloads, unclipped scales,
packing and decoding.  What is not: stochastic codes (the torch path draws from a
seeded ``torch.Generator`` on the device, the numpy path from PCG64DXSM), so those are
compared through their distribution: both must fire with exactly the probability the
16-bit rule gives (binomial bounds), and decode to the input on average.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fedddl.compression import (
    PayloadError,
    ResidualMemory,
    TernaryCompressor,
    TernaryPayload,
    decode_update,
    encode_update,
    local_scales,
    max_scales,
)
from fedddl.compression.backends import device_path
from fedddl.compression.backends.packing import packed_size
from fedddl.compression.codecs.wire import MAGIC
from tests.support.device_guard import DeviceGuard

CODECS = ["2bit", "base3"]


@pytest.fixture()
def torch_path() -> Iterator[None]:
    with device_path.torch_path_on_cpu():
        yield


def _grads(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Layer shapes of a small CNN, with sizes that are not multiples of 4 or 5."""
    generator = torch.Generator().manual_seed(11)
    shapes = {
        "conv1.weight": (16, 3, 3, 3),  # 432
        "bn1.weight": (16,),
        "conv2.weight": (32, 16, 3, 3),  # 4608
        "fc.weight": (10, 33),  # 330
        "fc.bias": (10,),
        "odd": (7,),
        "scalar": (),
        "empty": (0, 3),
    }
    return {
        name: (torch.randn(shape, generator=generator) * 0.01).to(dtype)
        for name, shape in shapes.items()
    }


def _encode_both(grads: dict[str, torch.Tensor], **options: object) -> tuple[bytes, bytes]:
    numpy_bytes = encode_update(grads, TernaryCompressor(**options))  # type: ignore[arg-type]
    with device_path.torch_path_on_cpu():
        torch_bytes = encode_update(grads, TernaryCompressor(**options))  # type: ignore[arg-type]
    return numpy_bytes, torch_bytes


# ------------------------------------------------------------------- bit-identical parts
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_deterministic_payloads_are_bit_identical_on_both_paths(
    codec: str, dtype: torch.dtype
) -> None:
    grads = _grads(dtype)
    numpy_bytes, torch_bytes = _encode_both(
        grads, deterministic=True, clip_sigma=None, codec=codec, min_numel=12
    )
    assert numpy_bytes == torch_bytes


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.9])
def test_deterministic_payloads_with_clipping_and_shared_scales_are_bit_identical(
    threshold: float,
) -> None:
    """With a shared scale the (path-dependent) clip bound only decides whether the cut
    is reachable, so the bytes agree."""
    grads = _grads()
    scales = {name: 2.0 * float(t.abs().max()) + 1.0 for name, t in grads.items() if t.numel()}
    options = {"deterministic": True, "threshold": threshold}
    numpy_bytes = encode_update(grads, TernaryCompressor(**options), scales=scales)  # type: ignore[arg-type]
    with device_path.torch_path_on_cpu():
        torch_bytes = encode_update(grads, TernaryCompressor(**options), scales=scales)  # type: ignore[arg-type]
    assert numpy_bytes == torch_bytes


def test_unclipped_scales_are_equal_and_clipped_ones_agree_to_float32_rounding() -> None:
    """Without clipping the scale is ``max|g|``, exact on both paths.  With clipping it is
    ``float32(2.5 * std)``: the torch path reduces in float64, so it is the float64
    ``np.std`` rounded (we allow 1 float32 step for the last float64 bit); the numpy path
    sums float32 chunks, measured up to ~45 float32 steps (4.7e-6) off on 262144 values with
    a large mean, so the two are compared at 1e-5."""
    generator = torch.Generator().manual_seed(3)
    for numel in (5, 330, 4608, 300_000):
        for offset in (0.0, 0.5):
            tensor = torch.randn(numel, generator=generator) * 0.3 + offset
            for clip in (None, 2.5):
                numpy_scale = TernaryCompressor(clip_sigma=clip).local_scale(tensor)
                with device_path.torch_path_on_cpu():
                    compressor = TernaryCompressor(clip_sigma=clip)
                    torch_scale = compressor.local_scale(tensor)
                    payload, _ = compressor.compress(tensor)
                assert isinstance(payload, TernaryPayload)
                assert payload.scale == torch_scale  # local_scale agrees with compress
                assert numpy_scale is not None and torch_scale is not None
                peak = float(tensor.abs().max())
                exact = min(peak, 2.5 * float(np.std(tensor.double().numpy())))
                if clip is None or exact == peak:
                    assert torch_scale == numpy_scale == float(np.float32(peak))
                else:
                    steps = abs(
                        int(np.float32(torch_scale).view(np.int32))
                        - int(np.float32(exact).view(np.int32))
                    )
                    assert steps <= 1
                    assert torch_scale == pytest.approx(numpy_scale, rel=1e-5)


@pytest.mark.parametrize("codec", CODECS)
def test_decoding_into_out_on_the_torch_path_equals_the_numpy_decode(codec: str) -> None:
    grads = _grads()
    data = encode_update(grads, TernaryCompressor(seed=4, codec=codec, min_numel=12))
    fresh = decode_update(data)
    out = {name: torch.full_like(t, float("nan")) for name, t in grads.items()}
    out["conv1.weight"] = out["conv1.weight"].half()
    out["fc.weight"] = torch.nn.Parameter(torch.zeros(10, 33))
    out["conv2.weight"] = torch.full((32, 16, 3, 6), float("nan"))[..., ::2]  # not contiguous
    assert not out["conv2.weight"].is_contiguous()
    with device_path.torch_path_on_cpu():
        decoded = decode_update(data, out=out)
    for name, tensor in decoded.items():
        assert tensor is out[name]
        expected = fresh[name].to(tensor.dtype)
        torch.testing.assert_close(tensor.detach(), expected, rtol=0, atol=0)


# ---------------------------------------------------------------- the stochastic torch path
def _fire_probability(value: float, scale: float) -> float:
    """The probability the 16-bit rule gives: ceil(float32(|g| * f) - 1/2) / 2**16."""
    factor = np.float32(65536.0 / scale)
    level = np.float32(np.float32(abs(value)) * factor) - np.float32(0.5)
    return min(max(math.ceil(float(level)), 0), 65536) / 65536.0


LEVELS = [0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.999, 1.0]


def _level_tensor(repeats: int) -> torch.Tensor:
    """Every level of LEVELS, positive and negative, ``repeats`` times (scale 1: max 1.0)."""
    row = torch.tensor(LEVELS + [-v for v in LEVELS[1:]])
    return row.repeat(repeats)


def _fire_counts(packed: torch.Tensor, numel: int, codec: str, width: int) -> np.ndarray:
    """Per column of the repeated row: how often it fired, and with which sign."""
    from fedddl.compression.backends.unpacking import unpack_codes

    values = unpack_codes(packed, numel, 1.0, codec).numpy().reshape(-1, width)
    return np.stack([(values > 0).sum(0), (values < 0).sum(0)])


@pytest.mark.parametrize("codec", CODECS)
def test_stochastic_codes_fire_with_the_16_bit_probability_on_both_paths(codec: str) -> None:
    """Each column of 200k copies of a level fires Binomial(n, p) times with the p of the
    rule; |count - n p| <= 5 sd + 1 fails a correct implementation with probability
    ~6e-7 per column.  Sign is that of g; zero never fires, |g| = s always does.  The
    numpy path is held to the same bound, so both have the same code distribution."""
    repeats = 200_000
    tensor = _level_tensor(repeats)
    width = tensor.numel() // repeats
    for forced in (True, False):
        with device_path.torch_path_on_cpu(forced):
            payload, _ = TernaryCompressor(seed=21, clip_sigma=None, codec=codec).compress(tensor)
        assert isinstance(payload, TernaryPayload) and payload.scale == 1.0
        positive, negative = _fire_counts(payload.codes, tensor.numel(), codec, width)
        row = tensor[:width].tolist()
        for column, value in enumerate(row):
            p = _fire_probability(value, 1.0)
            fired = positive[column] + negative[column]
            assert (negative if value > 0 else positive)[column] == 0 or value == 0
            bound = 5.0 * math.sqrt(repeats * p * (1 - p)) + 1
            assert abs(fired - repeats * p) <= bound, (forced, value, fired, repeats * p)
        assert positive[0] == negative[0] == 0  # g = 0
        assert positive[LEVELS.index(1.0)] == repeats  # g = s


def test_stochastic_torch_path_is_unbiased_over_many_draws(torch_path: None) -> None:
    """The mean of K decoded draws of a gradient-like tensor is within 5 standard errors
    (s * sqrt(p (1 - p) / K) per element, plus the 2**-17 s rounding bias) of the
    clipped input, for every element and for their sign-weighted sum."""
    draws = 400
    generator = torch.Generator().manual_seed(8)
    tensor = torch.randn(2000, generator=generator) * 0.02
    compressor = TernaryCompressor(seed=5, clip_sigma=2.5)
    total = torch.zeros(2000, dtype=torch.float64)
    scale = compressor.local_scale(tensor)
    assert scale is not None
    for _ in range(draws):
        payload, ctx = compressor.compress(tensor)
        total += compressor.decompress(payload, ctx).double()
    mean = total / draws
    clipped = tensor.double().clamp(-scale, scale)
    p = (clipped.abs() / scale).clamp(0, 1)
    variance = scale**2 * p * (1 - p) / draws  # of each element's mean
    bound = 5 * variance.sqrt() + scale * 2.0**-17 + 1e-12
    assert bool(((mean - clipped).abs() <= bound).all())
    # all elements together, sign-weighted (a magnitude bias does not cancel): the error is
    # within 5 sd, and that bound is below a 1 % bias of every |g|, so it would catch one
    error = float((torch.sign(clipped) * (mean - clipped)).sum())
    tolerance = 5 * math.sqrt(float(variance.sum())) + 2000 * scale * 2.0**-17
    assert abs(error) <= tolerance
    assert tolerance < 0.01 * float(clipped.abs().sum())


def test_the_torch_path_is_reproducible_and_seeded(torch_path: None) -> None:
    grads = _grads()
    first = encode_update(grads, TernaryCompressor(seed=3))
    assert encode_update(grads, TernaryCompressor(seed=3)) == first
    assert encode_update(grads, TernaryCompressor(seed=4)) != first
    compressor = TernaryCompressor(seed=3)
    assert encode_update(grads, compressor) == first
    assert encode_update(grads, compressor) != first  # the generator moved on


def test_batches_on_the_torch_path_equal_one_tensor_at_a_time(torch_path: None) -> None:
    tensors = list(_grads().values())
    batched = TernaryCompressor(seed=9, codec="base3", min_numel=12).compress_batch(tensors)
    single = TernaryCompressor(seed=9, codec="base3", min_numel=12)
    for tensor, (payload, ctx) in zip(tensors, batched, strict=True):
        one, one_ctx = single.compress(tensor)
        assert one_ctx == ctx
        assert type(one) is type(payload)
        if isinstance(one, TernaryPayload):
            assert isinstance(payload, TernaryPayload)
            assert (one.scale, one.numel) == (payload.scale, payload.numel)
            assert torch.equal(one.codes, payload.codes)
        else:
            assert torch.equal(one.values, payload.values)  # type: ignore[union-attr]


def test_an_error_names_the_tensor_and_leaves_the_generator_unmoved(torch_path: None) -> None:
    tensors = [torch.ones(40), torch.randn(50), torch.tensor([1.0, float("nan")])]
    compressor = TernaryCompressor(seed=2)
    with pytest.raises(ValueError, match=r"tensor 2: .*NaN"):
        compressor.compress_batch(tensors)
    with pytest.raises(ValueError, match="tensor 1: shared scale"):
        compressor.compress_batch(tensors[:2], [None, 1e-9])
    with pytest.raises(ValueError, match="NaN"):
        TernaryCompressor(min_numel=5).compress(torch.tensor([float("inf")]))
    after, _ = compressor.compress(tensors[1])
    fresh, _ = TernaryCompressor(seed=2).compress(tensors[1])
    assert isinstance(after, TernaryPayload) and isinstance(fresh, TernaryPayload)
    assert torch.equal(after.codes, fresh.codes)


def test_error_feedback_on_the_torch_path_keeps_what_was_not_sent(torch_path: None) -> None:
    grads = _grads()
    memory = ResidualMemory()
    data = encode_update(grads, TernaryCompressor(seed=1, min_numel=12), memory)
    decoded = decode_update(data)
    for name, tensor in grads.items():
        torch.testing.assert_close(memory.residuals[name], tensor - decoded[name], rtol=0, atol=0)


def test_scaler_sharing_on_the_torch_path(torch_path: None) -> None:
    grads = {name: t for name, t in _grads().items() if t.numel()}
    mine = local_scales(grads, TernaryCompressor(seed=0))
    theirs = local_scales({n: 3 * t for n, t in grads.items()}, TernaryCompressor(seed=1))
    shared = max_scales([mine, theirs])
    decoded = decode_update(encode_update(grads, TernaryCompressor(seed=0), scales=shared))
    for name, tensor in decoded.items():
        assert set(tensor.abs().unique().tolist()) <= {0.0, float(np.float32(shared[name]))}


# ------------------------------------------------------------------------- decoding safely
def _corrupt_last_code_byte_of(data: bytes, grads: dict[str, torch.Tensor], name: str) -> bytes:
    import struct
    import zlib

    names = list(grads)
    after = sum(packed_size(grads[n].numel(), "2bit") for n in names[names.index(name) + 1 :])
    buffer = bytearray(data)
    buffer[len(buffer) - 4 - after - 1] = 0xFF  # four 0b11 codes
    buffer[-4:] = struct.pack("<I", zlib.crc32(bytes(buffer[:-4])))
    return bytes(buffer)


def test_a_bad_message_writes_nothing_on_the_torch_path(torch_path: None) -> None:
    grads = {name: t for name, t in _grads().items() if t.numel() > 4}
    data = encode_update(grads, TernaryCompressor(seed=0))
    bad = _corrupt_last_code_byte_of(data, grads, "fc.weight")  # a later entry
    out = {name: torch.zeros_like(t) for name, t in grads.items()}
    with pytest.raises(PayloadError, match=r"'fc\.weight': invalid ternary code"):
        decode_update(bad, out=out)
    truncated = data[:-9] + data[-4:]
    with pytest.raises(PayloadError):
        decode_update(truncated, out=out)
    for tensor in out.values():
        assert not bool(tensor.any())
    decode_update(data, out=out)  # the good message is written
    assert bool(out["conv2.weight"].any())


# ------------------------------------------------------------------------ transfers, meta
def _count_transfers(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"to_host": 0, "to_device": 0}
    real_host, real_device = device_path.to_host, device_path.to_device

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        counts["to_host"] += 1
        return real_host(tensor)

    def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        counts["to_device"] += 1
        return real_device(tensor, device)

    monkeypatch.setattr(device_path, "to_host", to_host)
    monkeypatch.setattr(device_path, "to_device", to_device)
    return counts


def test_a_batch_crosses_to_the_host_twice_and_decoding_once(
    torch_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = _count_transfers(monkeypatch)
    grads = _grads()
    data = encode_update(grads, TernaryCompressor(seed=0, min_numel=12))
    assert counts == {"to_host": 2, "to_device": 0}  # statistics, then every tensor's bytes
    decode_update(data, out={name: torch.empty_like(t) for name, t in grads.items()})
    assert counts == {"to_host": 2, "to_device": 1}  # every ternary entry's packed bytes


def _fake_host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """What a device would send back, for meta tensors (which hold no data): statistics of
    1.0 (max|g| = std = 1, every flag finite) and zero code bytes."""
    fill = 1.0 if tensor.dtype == torch.float64 else 0
    return torch.full(tensor.shape, fill, dtype=tensor.dtype)


def _meta_grads() -> dict[str, torch.Tensor]:
    grads = {name: t.to("meta") for name, t in _grads().items()}
    grads["half"] = torch.empty(9, 5, dtype=torch.float16, device="meta")
    return grads


@pytest.mark.parametrize("codec", CODECS)
def test_encoding_meta_tensors_mixes_no_devices(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole encode path (statistics, scales, ternarising, packing, dense tensors,
    error feedback) on meta tensors: no op sees two devices except the declared
    transfers, and those are only the packed bytes going back for error feedback."""
    monkeypatch.setattr(device_path, "to_host", _fake_host_copy)
    grads = _meta_grads()
    memory = ResidualMemory()
    guard = DeviceGuard()
    with guard:
        data = encode_update(grads, TernaryCompressor(seed=0, min_numel=12, codec=codec), memory)
    assert data[:4] == MAGIC
    ternary = [n for n, t in grads.items() if t.numel() >= 12]
    dense = [n for n, t in grads.items() if t.numel() < 12]
    # error feedback rebuilds the sent values on meta: packed codes (ternary) or values (dense)
    assert [(op, str(a), str(b)) for op, a, b in guard.transfers] == [
        ("to", "cpu", "meta") for _ in grads
    ]
    assert len(ternary) + len(dense) == len(grads)
    residuals = memory.residuals
    assert all(residuals[name].device.type == "meta" for name in grads)
    assert decode_update(data)["conv2.weight"].abs().sum() == 0  # the fake zero codes


def test_decoding_into_meta_tensors_mixes_no_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = _grads()
    data = encode_update(grads, TernaryCompressor(seed=0, min_numel=12))
    out = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in grads.items()}
    out["odd"] = torch.empty(7, dtype=torch.bfloat16, device="meta")
    guard = DeviceGuard()
    with guard:
        decode_update(data, out=out)
    dense = sum(1 for t in grads.values() if t.numel() < 12)  # the empty tensor included
    transfers = [(op, str(a), str(b)) for op, a, b in guard.transfers]
    # one copy of every ternary entry's packed bytes, then one per dense (uncompressed) entry
    assert transfers.count(("to", "cpu", "meta")) == 1
    assert transfers.count(("copy_", "cpu", "meta")) == dense
    assert len(transfers) == 1 + dense


def test_the_torch_path_switch_is_scoped() -> None:
    cpu = torch.zeros(3)
    assert not device_path.uses_torch_path([cpu])
    with device_path.torch_path_on_cpu():
        assert device_path.uses_torch_path([cpu]) and device_path.unpacks_on_device(cpu)
        with device_path.torch_path_on_cpu(False):
            assert not device_path.uses_torch_path([cpu])
    assert not device_path.uses_torch_path([cpu]) and not device_path.unpacks_on_device(cpu)
    assert device_path.uses_torch_path([cpu, torch.zeros(3, device="meta")])
    assert device_path.unpacks_on_device(torch.zeros(3, device="meta"))
