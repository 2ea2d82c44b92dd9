"""``fedddl bench <target>``: throughput and size figures, printed side by side.

Targets:

``compression``
    On ``--numel`` random fp32 values (or, with ``--shapes resnet18``, on
    random tensors shaped like the CIFAR ResNet-18's parameters): the naive
    reference (``torch.rand`` TernGrad + straightforward packing),
    ``encode_update`` / ``decode_update`` with the 2-bit and base-3 codecs
    (decoding into new tensors, and with ``out=`` into warm, reused
    buffers), the fp32 identity baseline, and two memory copies: into a new
    tensor (``clone()``) and into a warm buffer (``copy_``), as GB/s of fp32
    input (``4 * numel / seconds``, best of ``--repeats``, cases
    interleaved), by wall clock and per CPU-second of this process (the
    fairer figure on a shared, loaded machine).  Then message sizes on real
    gradients (MLP and CNN on scikit-learn digits): 2-bit, base-3 and zlib
    of each.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

NAME = "bench"
HELP = "benchmarks, printed side by side (targets: compression)"
TARGETS = ("compression",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` arguments."""
    parser.add_argument("target", choices=TARGETS, help="what to benchmark")
    parser.add_argument(
        "--numel", type=int, default=25_000_000, help="fp32 values of the flat update"
    )
    parser.add_argument(
        "--shapes",
        choices=("flat", "resnet18"),
        default="flat",
        help="flat: one tensor of --numel values; resnet18: the 62 parameter tensors of the "
        "CIFAR ResNet-18 (11.2 M values, --numel ignored)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs of each case; the best is kept"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data and compressors")
    parser.add_argument("--no-gradients", action="store_true", help="skip the real-gradient sizes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _timed(action: Callable[[], object]) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def _update(shapes: str, numel: int, seed: int) -> dict[str, Any]:
    """The benchmarked update: random normal values in the requested shapes."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    if shapes == "flat":
        return {"values": torch.randn(numel, generator=generator)}
    from fedddl.models import create_model

    model = create_model("cifar10", seed=seed, arch="resnet18")
    return {
        name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()
    }


def _throughput(update: dict[str, Any], repeats: int, seed: int) -> list[dict[str, Any]]:
    import torch

    from fedddl.compression import (
        IdentityCompressor,
        TernaryCompressor,
        decode_update,
        encode_update,
    )
    from fedddl.compression.reference import naive_pack, naive_ternarize

    numel = sum(t.numel() for t in update.values())
    values = torch.cat([t.reshape(-1) for t in update.values()])  # the copies and the naive case
    generator = torch.Generator().manual_seed(seed)
    ternary = TernaryCompressor(seed=seed)
    base3 = TernaryCompressor(seed=seed, codec="base3")
    identity = IdentityCompressor()
    warm = {name: torch.empty_like(t) for name, t in update.items()}
    copy_target = torch.empty_like(values)
    messages = {
        "2bit": encode_update(update, ternary),
        "base3": encode_update(update, base3),
        "identity": encode_update(update, identity),
    }
    cases: list[tuple[str, Callable[[], object], int | None]] = [
        ("memory copy, new tensor (clone)", values.clone, None),
        ("memory copy, warm buffer (copy_)", lambda: copy_target.copy_(values), None),
        (
            "naive: torch.rand ternarize + pack",
            lambda: naive_pack(naive_ternarize(values, generator)[0]),
            None,
        ),
        (
            "encode_update ternary 2-bit",
            lambda: encode_update(update, ternary),
            len(messages["2bit"]),
        ),
        ("decode_update ternary 2-bit", lambda: decode_update(messages["2bit"]), None),
        (
            "decode_update ternary 2-bit, out=warm",
            lambda: decode_update(messages["2bit"], out=warm),
            None,
        ),
        (
            "encode_update ternary base-3",
            lambda: encode_update(update, base3),
            len(messages["base3"]),
        ),
        ("decode_update ternary base-3", lambda: decode_update(messages["base3"]), None),
        (
            "decode_update ternary base-3, out=warm",
            lambda: decode_update(messages["base3"], out=warm),
            None,
        ),
        (
            "encode_update identity fp32",
            lambda: encode_update(update, identity),
            len(messages["identity"]),
        ),
        ("decode_update identity fp32", lambda: decode_update(messages["identity"]), None),
    ]
    # interleave the cases so every one sees the same machine load
    best = {name: float("inf") for name, _, _ in cases}
    best_cpu = dict(best)
    for _ in range(repeats):
        for name, action, _ in cases:
            wall, cpu = _timed(action)
            best[name] = min(best[name], wall)
            best_cpu[name] = min(best_cpu[name], cpu)
    rows = []
    for name, _, size in cases:
        rows.append(
            {
                "case": name,
                "seconds": best[name],
                "gb_per_s": 4 * numel / best[name] / 1e9,
                "cpu_seconds": best_cpu[name],
                "gb_per_cpu_s": 4 * numel / max(best_cpu[name], 1e-9) / 1e9,
                "message_bytes": size,
                "ratio_vs_fp32": None if size is None else 4 * numel / size,
            }
        )
    return rows


def _digits_gradients(seed: int) -> dict[str, dict[str, Any]]:
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    torch.manual_seed(seed)
    models = {
        "mlp 64-128-10": (
            torch.nn.Sequential(
                torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
            ),
            x,
        ),
        "cnn 2 conv + fc": (
            torch.nn.Sequential(
                torch.nn.Conv2d(1, 16, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Conv2d(16, 32, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Flatten(),
                torch.nn.Linear(32 * 64, 10),
            ),
            x.view(-1, 1, 8, 8),
        ),
    }
    result = {}
    for name, (model, inputs) in models.items():
        batch = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:32]
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs[batch]), y[batch])
        loss.backward()  # type: ignore[no-untyped-call]
        grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        result[name] = grads
    return result


def _gradient_sizes(seed: int) -> list[dict[str, Any]]:
    import math
    import zlib

    from fedddl.compression import TernaryCompressor, decode_update, encode_update

    rows = []
    for model, grads in _digits_gradients(seed).items():
        numel = sum(g.numel() for g in grads.values())
        two_bit = encode_update(grads, TernaryCompressor(seed=seed))
        base3 = encode_update(grads, TernaryCompressor(seed=seed, codec="base3"))
        decoded = decode_update(two_bit)
        zeros = sum(int((t == 0).sum()) for t in decoded.values()) / numel
        p_nonzero = (1 - zeros) / 2
        entropy = -sum(p * math.log2(p) for p in (zeros, p_nonzero, p_nonzero) if p > 0)
        rows.append(
            {
                "model": model,
                "params": numel,
                "fp32_bytes": 4 * numel,
                "2bit_bytes": len(two_bit),
                "base3_bytes": len(base3),
                "zlib9_2bit_bytes": len(zlib.compress(two_bit, 9)),
                "zlib9_base3_bytes": len(zlib.compress(base3, 9)),
                "zero_fraction": zeros,
                "entropy_bits_per_value": entropy,
            }
        )
    return rows


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    header = " | ".join(f"{title:>{width}}" for _, title, width in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = []
        for key, _, width in columns:
            value = row[key]
            if value is None:
                text = "-"
            elif isinstance(value, float):
                text = f"{value:.3f}" if value < 1000 else f"{value:.0f}"
            else:
                text = str(value)
            cells.append(f"{text:>{width}}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark of ``args.target``."""
    if args.numel < 1 or args.repeats < 1:
        print("--numel and --repeats must be at least 1")
        return 2
    import torch

    update = _update(args.shapes, args.numel, args.seed)
    report: dict[str, Any] = {
        "shapes": args.shapes,
        "numel": sum(t.numel() for t in update.values()),
        "tensors": len(update),
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "throughput": _throughput(update, args.repeats, args.seed),
    }
    if not args.no_gradients:
        report["gradient_sizes"] = _gradient_sizes(args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"fedddl bench compression: {report['numel']} fp32 values in {report['tensors']} "
        f"tensor(s) ({args.shapes}), best of {args.repeats}, "
        f"{report['torch_threads']} torch threads"
    )
    print(
        _table(
            report["throughput"],
            [
                ("case", "case", "38"),
                ("seconds", "seconds", "9"),
                ("gb_per_s", "GB/s fp32", "9"),
                ("cpu_seconds", "CPU s", "8"),
                ("gb_per_cpu_s", "GB/CPU-s", "8"),
                ("message_bytes", "bytes", "10"),
                ("ratio_vs_fp32", "x smaller", "9"),
            ],
        )
    )
    if "gradient_sizes" in report:
        print("\nmessage sizes on real gradients (digits, one batch of 32, random init)")
        print(
            _table(
                report["gradient_sizes"],
                [
                    ("model", "model", "16"),
                    ("params", "params", "7"),
                    ("fp32_bytes", "fp32", "7"),
                    ("2bit_bytes", "2-bit", "6"),
                    ("base3_bytes", "base-3", "6"),
                    ("zlib9_2bit_bytes", "zlib(2-bit)", "11"),
                    ("zlib9_base3_bytes", "zlib(base-3)", "12"),
                    ("zero_fraction", "zeros", "5"),
                    ("entropy_bits_per_value", "H bits", "6"),
                ],
            )
        )
    return 0
