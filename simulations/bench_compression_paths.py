"""What the torch (device) path of TernGrad compression costs next to the numpy path.

Side by side in one run, on the same tensors (one 25 M-value tensor, and random tensors
shaped like the CIFAR ResNet-18's 62 parameters, 11.2 M values): ``encode_update`` with
the stochastic ternary compressor and ``decode_update(out=warm buffers)``, 2-bit and
base-3, through

* ``numpy``: the threaded numpy path (the CPU's);
* ``torch``: the device-generic torch kernels (``torch_path_on_cpu`` on the CPU, or the
  tensors' own device with ``--device cuda``);
* with ``--device cuda`` also ``host copy + numpy``: ``.cpu()`` of every tensor, then the
  numpy path (what a GPU client did before the torch path existed).

Cases are interleaved and the best of ``--repeats`` is kept; figures are GB/s of fp32
input (``4 * numel / seconds``).  The last line of each block is the ratio torch/numpy.

    python -m simulations.bench_compression_paths [--repeats 5] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fedddl.compression import TernaryCompressor, decode_update, encode_update
from fedddl.compression.backends import device_path
from fedddl.models import cifar_resnet18


def _updates(seed: int, device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    model = cifar_resnet18((3, 32, 32), 10)
    resnet = {
        name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()
    }
    flat = {"values": torch.randn(25_000_000, generator=generator)}
    return {
        "25 M values, 1 tensor": {k: v.to(device) for k, v in flat.items()},
        "ResNet-18 shapes, 62 tensors": {k: v.to(device) for k, v in resnet.items()},
    }


def _cases(
    update: dict[str, torch.Tensor], codec: str, device: torch.device
) -> list[tuple[str, Callable[[], object]]]:
    on_host = {name: t.cpu() for name, t in update.items()}
    warm_host = {name: torch.empty_like(t) for name, t in on_host.items()}
    warm_device = {name: torch.empty_like(t) for name, t in update.items()}
    message = encode_update(on_host, TernaryCompressor(codec=codec))
    numpy_compressor = TernaryCompressor(seed=1, codec=codec)
    torch_compressor = TernaryCompressor(seed=1, codec=codec)
    on_cpu = device.type == "cpu"

    def torch_encode() -> object:
        with device_path.torch_path_on_cpu(on_cpu):
            return encode_update(update, torch_compressor)

    def torch_decode() -> object:
        with device_path.torch_path_on_cpu(on_cpu):
            return decode_update(message, out=warm_device)

    cases: list[tuple[str, Callable[[], object]]] = [
        ("encode numpy", lambda: encode_update(on_host, numpy_compressor)),
        ("encode torch", torch_encode),
        ("decode(out=) numpy", lambda: decode_update(message, out=warm_host)),
        ("decode(out=) torch", torch_decode),
    ]
    if not on_cpu:
        cases.append(
            (
                "encode host copy + numpy",
                lambda: encode_update({n: t.cpu() for n, t in update.items()}, numpy_compressor),
            )
        )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {device}")
    for label, update in _updates(args.seed, device).items():
        numel = sum(t.numel() for t in update.values())
        for codec in ("2bit", "base3"):
            cases = _cases(update, codec, device)
            best = {name: float("inf") for name, _ in cases}
            for _ in range(args.repeats):
                for name, action in cases:
                    sync()
                    start = time.perf_counter()
                    action()
                    sync()
                    best[name] = min(best[name], time.perf_counter() - start)
            rate = {name: 4 * numel / seconds / 1e9 for name, seconds in best.items()}
            title = f"{label}, {codec} ({numel} values)"
            print(f"\n{title}: GB/s of fp32 input, best of {args.repeats}")
            for name, _ in cases:
                print(f"  {name:28s} {rate[name]:8.3f}")
            print(
                f"  torch/numpy: encode {rate['encode torch'] / rate['encode numpy']:.3f}, "
                f"decode(out=) {rate['decode(out=) torch'] / rate['decode(out=) numpy']:.3f}"
            )


if __name__ == "__main__":
    main()
