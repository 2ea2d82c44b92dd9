"""One TernGrad round of compression on CUDA: ResNet-18 gradients computed on the GPU are
ternarised and packed there, cross as packed bytes, and decode onto the GPU.

Marked ``gpu``; skipped where ``torch.cuda.is_available()`` is false (CI, this project's
development machines).  Run with ``pytest -m gpu``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedddl.compression import (
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
from fedddl.compression.backends.unpacking import unpack_codes
from fedddl.models import cifar_resnet18

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cuda_gradients() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = cifar_resnet18((3, 32, 32), 10).cuda()
    images = torch.randn(16, 3, 32, 32, device="cuda")
    labels = torch.randint(0, 10, (16,), device="cuda")
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]


@pytest.mark.parametrize("codec", ["2bit", "base3"])
def test_one_terngrad_round_on_cuda(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    grads = _cuda_gradients()
    assert all(t.is_cuda for t in grads.values())
    copies = {"to_host": 0}
    real = device_path.to_host

    def counted(tensor: torch.Tensor) -> torch.Tensor:
        copies["to_host"] += 1
        assert tensor.dtype in (torch.uint8, torch.float64)  # packed bytes or statistics
        return real(tensor)

    monkeypatch.setattr(device_path, "to_host", counted)
    # scaler sharing, then the client's encode with error feedback, all on the GPU
    compressor = TernaryCompressor(seed=1, codec=codec, min_numel=100)
    shared = max_scales([local_scales(grads, compressor)])
    copies["to_host"] = 0
    memory = ResidualMemory()
    data = encode_update(grads, compressor, memory, scales=shared)
    assert copies["to_host"] == 2  # statistics, then every tensor's bytes
    body = sum(
        packed_size(t.numel(), codec) if t.numel() >= 100 else 4 * t.numel() for t in grads.values()
    )
    assert body < len(data) < body + 100 * len(grads)  # only bytes and small headers
    # the server decodes on the host; a client decodes onto the GPU: the same values
    on_host = decode_update(data)
    on_gpu = {name: torch.full_like(t, float("nan")) for name, t in grads.items()}
    decode_update(data, out=on_gpu)
    for name, tensor in grads.items():
        assert on_gpu[name].is_cuda
        torch.testing.assert_close(on_gpu[name].cpu(), on_host[name], rtol=0, atol=0)
        residual = memory.residuals[name]
        assert residual.is_cuda
        torch.testing.assert_close(residual, tensor - on_gpu[name], rtol=0, atol=0)


def test_cuda_deterministic_bytes_equal_the_cpu_path_and_stochastic_ones_repeat() -> None:
    grads = _cuda_gradients()
    on_cpu = {name: t.cpu() for name, t in grads.items()}
    options = {"deterministic": True, "clip_sigma": None, "min_numel": 100}
    cuda_bytes = encode_update(grads, TernaryCompressor(**options))  # type: ignore[arg-type]
    assert cuda_bytes == encode_update(on_cpu, TernaryCompressor(**options))  # type: ignore[arg-type]
    first = encode_update(grads, TernaryCompressor(seed=5))
    assert encode_update(grads, TernaryCompressor(seed=5)) == first
    assert encode_update(grads, TernaryCompressor(seed=6)) != first


def test_cuda_codes_fire_with_the_16_bit_probability() -> None:
    repeats = 200_000
    levels = [0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    row = torch.tensor(levels + [-v for v in levels[1:]])
    tensor = row.repeat(repeats).cuda()
    payload, _ = TernaryCompressor(seed=3, clip_sigma=None).compress(tensor)
    assert isinstance(payload, TernaryPayload) and payload.scale == 1.0
    values = unpack_codes(payload.codes, tensor.numel(), 1.0, "2bit").numpy()
    values = values.reshape(repeats, -1)
    for column, value in enumerate(row.tolist()):
        level = np.float32(np.float32(abs(value)) * np.float32(65536.0)) - np.float32(0.5)
        p = min(max(math.ceil(float(level)), 0), 65536) / 65536.0
        fired = int((values[:, column] != 0).sum())
        assert int((np.sign(values[:, column]) * np.sign(value) < 0).sum()) == 0
        assert abs(fired - repeats * p) <= 5.0 * math.sqrt(repeats * p * (1 - p)) + 1
