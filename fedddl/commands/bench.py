"""``fedddl bench <target>``: throughput and size figures, printed side by side.

Targets:

``compression``
    For each shape set (``--shapes``: one tensor of ``--numel`` random fp32
    values, and/or random tensors shaped like the 62 parameters of the CIFAR
    ResNet-18), in one run and with the cases interleaved so that every case
    sees the same machine load: two memory copies of the same tensors (into
    new tensors, ``clone()``, and into warm buffers, ``copy_``), the naive
    reference (``torch.rand`` TernGrad + straightforward packing), GRACE's
    TernGrad compress and decompress (:mod:`fedddl.commands._bench_baselines`),
    ``encode_update`` / ``decode_update`` with the 2-bit, base-3 and
    entropy-coded ternary codecs (decoding into new tensors, and with
    ``out=`` into warm, reused buffers) and with the fp32 identity codec.
    Figures are GB/s of fp32 input (``4 * numel / seconds``, best of
    ``--repeats``), by wall clock and per CPU-second of this process, and
    each of ours is also given as a multiple of its reference measured in the
    same run (encode: GRACE's compress; ternary decode: GRACE's decompress;
    identity: the warm ``copy_``).  Then message sizes on real gradients
    (:mod:`fedddl.commands._bench_gradients`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from fedddl.commands._bench_gradients import DEFAULT_MODELS, gradient_sizes, parse_models

NAME = "bench"
HELP = "benchmarks, printed side by side (targets: compression)"
TARGETS = ("compression",)
SHAPE_SETS = ("flat", "resnet18")

_GRACE_COMPRESS = "GRACE TernGrad compress (clip, uniform_, int8)"
_GRACE_DECOMPRESS = "GRACE TernGrad decompress (int8 x s, new)"
_COPY_WARM = "memory copy, warm buffer (copy_)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` arguments."""
    parser.add_argument("target", choices=TARGETS, help="what to benchmark")
    parser.add_argument(
        "--numel", type=int, default=25_000_000, help="fp32 values of the flat update"
    )
    parser.add_argument(
        "--shapes",
        choices=(*SHAPE_SETS, "both"),
        default="both",
        help="flat: one tensor of --numel values; resnet18: the 62 parameter tensors of the "
        "CIFAR ResNet-18 (11.2 M values); both (default): one after the other, in one run",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs of each case; the best is kept"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads, used by torch and by our kernels alike (0: torch's default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data and compressors")
    parser.add_argument("--no-gradients", action="store_true", help="skip the real-gradient sizes")
    parser.add_argument(
        "--gradient-models",
        default=DEFAULT_MODELS,
        help="dataset:arch pairs whose real gradients are measured, comma-separated "
        f"(default {DEFAULT_MODELS}; e.g. add fashion-mnist:resnet18)",
    )
    parser.add_argument(
        "--gradient-steps",
        type=int,
        default=0,
        help="SGD steps on the dataset before the measured gradient (0: random init)",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="let glibc reuse freed large blocks (fedddl.compression.backends.allocator) before "
        "measuring: no first-touch page faults for new messages and tensors",
    )
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


Case = tuple[str, Callable[[], object], int | None, str | None]


def _cases(update: dict[str, Any], seed: int) -> list[Case]:
    """``(name, action, message bytes, reference case)`` of every timed case."""
    import torch

    from fedddl.commands._bench_baselines import (
        grace_terngrad_compress,
        grace_terngrad_decompress,
        naive_pack,
        naive_ternarize,
    )
    from fedddl.compression import (
        IdentityCompressor,
        TernaryCompressor,
        TernaryEntropyCompressor,
        decode_update,
        encode_update,
        limits_for,
    )

    tensors = list(update.values())
    values = torch.cat([t.reshape(-1) for t in tensors])  # the naive case: one tensor
    generator = torch.Generator().manual_seed(seed)
    warm = {name: torch.empty_like(t).fill_(0) for name, t in update.items()}
    copy_targets = list(warm.values())
    grace = [grace_terngrad_compress(t) for t in tensors]
    compressors = {
        "ternary 2-bit": TernaryCompressor(seed=seed),
        "ternary base-3": TernaryCompressor(seed=seed, codec="base3"),
        "ternary-entropy": TernaryEntropyCompressor(seed=seed),
        "identity fp32": IdentityCompressor(),
    }

    def copy_all() -> None:
        for target, source in zip(copy_targets, tensors, strict=True):
            target.copy_(source)

    cases: list[Case] = [
        ("memory copy, new tensor (clone)", lambda: [t.clone() for t in tensors], None, None),
        (_COPY_WARM, copy_all, None, None),
        (
            "naive: torch.rand ternarize + pack",
            lambda: naive_pack(naive_ternarize(values, generator)[0]),
            None,
            None,
        ),
        (_GRACE_COMPRESS, lambda: [grace_terngrad_compress(t) for t in tensors], None, None),
        (
            _GRACE_DECOMPRESS,
            lambda: [grace_terngrad_decompress(*pair) for pair in grace],
            None,
            None,
        ),
    ]
    from fedddl.compression.codecs.message_buffer import MessageBuffer

    buffers = {label: MessageBuffer() for label in compressors}  # warm: one per codec
    for label, compressor in compressors.items():
        message = encode_update(update, compressor)
        encode_update(update, compressor, into=buffers[label])
        ternary = label != "identity fp32"
        cases += [
            (
                f"encode_update {label}",
                lambda c=compressor: encode_update(update, c),  # type: ignore[misc]
                len(message),
                _GRACE_COMPRESS if ternary else _COPY_WARM,
            ),
            (
                f"encode_update {label}, into=warm",
                lambda c=compressor, b=buffers[label]: encode_update(update, c, into=b),  # type: ignore[misc]
                len(message),
                _GRACE_COMPRESS if ternary else _COPY_WARM,
            ),
            (
                f"decode_update {label}",
                lambda m=message: decode_update(m, **limits_for(update)),  # type: ignore[misc]
                None,
                _GRACE_DECOMPRESS if ternary else _COPY_WARM,
            ),
            (
                f"decode_update {label}, out=warm",
                lambda m=message: decode_update(m, out=warm),  # type: ignore[misc]
                None,
                _GRACE_DECOMPRESS if ternary else _COPY_WARM,
            ),
        ]
    return cases


def _throughput(update: dict[str, Any], repeats: int, seed: int) -> list[dict[str, Any]]:
    numel = sum(t.numel() for t in update.values())
    cases = _cases(update, seed)
    # interleave the cases so every one sees the same machine load
    best = {name: float("inf") for name, *_ in cases}
    best_cpu = dict(best)
    for _ in range(repeats):
        for name, action, _, _ in cases:
            wall, cpu = _timed(action)
            best[name] = min(best[name], wall)
            best_cpu[name] = min(best_cpu[name], cpu)
    rows = []
    for name, _, size, reference in cases:
        rows.append(
            {
                "case": name,
                "seconds": best[name],
                "gb_per_s": 4 * numel / best[name] / 1e9,
                "cpu_seconds": best_cpu[name],
                "gb_per_cpu_s": 4 * numel / max(best_cpu[name], 1e-9) / 1e9,
                "message_bytes": size,
                "ratio_vs_fp32": None if size is None else 4 * numel / size,
                "reference": reference,
                "x_reference": None if reference is None else best[reference] / best[name],
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


def _print_report(report: dict[str, Any]) -> None:
    for run in report["runs"]:
        print(
            f"fedddl bench compression: {run['numel']} fp32 values in {run['tensors']} "
            f"tensor(s) ({run['shapes']}), best of {report['repeats']}, "
            f"{report['torch_threads']} torch threads, compiled kernels: {report['jit']}, "
            f"freed memory kept: {report['keep_freed_memory']}"
        )
        print(
            _table(
                run["throughput"],
                [
                    ("case", "case", "44"),
                    ("seconds", "seconds", "8"),
                    ("gb_per_s", "GB/s fp32", "9"),
                    ("gb_per_cpu_s", "GB/CPU-s", "8"),
                    ("x_reference", "x ref", "6"),
                    ("message_bytes", "bytes", "9"),
                    ("ratio_vs_fp32", "x smaller", "9"),
                ],
            )
        )
        print("x ref: encode vs GRACE compress, ternary decode vs GRACE decompress, "
              "identity vs copy_ (same run)\n")
    if "gradient_sizes" in report:
        print("message sizes on real gradients (one batch of 32; @k: after k SGD steps)")
        print(
            _table(
                report["gradient_sizes"],
                [
                    ("model", "model", "28"),
                    ("params", "params", "8"),
                    ("2bit_bytes", "2-bit", "7"),
                    ("base3_bytes", "base-3", "7"),
                    ("entropy_bytes", "entropy", "7"),
                    ("entropy_vs_base3", "/base-3", "7"),
                    ("order0_bound_vs_base3", "bound", "5"),
                    ("zlib9_2bit_bytes", "zlib(2-bit)", "11"),
                    ("zero_fraction", "zeros", "5"),
                    ("entropy_bits_per_value", "H bits", "6"),
                ],
            )
        )
        print("bound: each tensor's codes at their empirical entropy plus the base-3 headers")
        for note in report.get("notes", []):
            print(note)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark of ``args.target``."""
    if args.numel < 1 or args.repeats < 1 or args.gradient_steps < 0 or args.threads < 0:
        print("--numel and --repeats must be at least 1, --gradient-steps and --threads at least 0")
        return 2
    try:
        models = parse_models(args.gradient_models)
    except ValueError as error:
        print(f"--gradient-models: {error}")
        return 2
    import torch

    from fedddl.compression.backends import jit
    from fedddl.compression.backends.allocator import keep_freed_memory

    kept = keep_freed_memory() if args.keep_freed_memory else False
    if args.threads:
        torch.set_num_threads(args.threads)
    shape_sets = SHAPE_SETS if args.shapes == "both" else (args.shapes,)
    report: dict[str, Any] = {
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "jit": jit.available(),
        "keep_freed_memory": kept,
        "runs": [],
    }
    for shapes in shape_sets:
        update = _update(shapes, args.numel, args.seed)
        report["runs"].append(
            {
                "shapes": shapes,
                "numel": sum(t.numel() for t in update.values()),
                "tensors": len(update),
                "throughput": _throughput(update, args.repeats, args.seed),
            }
        )
        del update
    if not args.no_gradients:
        report["gradient_sizes"], report["notes"] = gradient_sizes(
            models, args.gradient_steps, args.seed
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0
