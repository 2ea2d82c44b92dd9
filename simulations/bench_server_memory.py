"""Peak server memory of one TernGrad round against the number of replies.

Builds ResNet-18-shaped (CIFAR-10, 62 parameter tensors, 11.2 M values) encoded gradients
(``ternary-base3``) with BatchNorm statistics and aggregates 4, 16 and 64 of them through
the real server code (:meth:`fedddl.sync.server.ReplicaServer.aggregate`: checks, decoding,
averaging, downlink encoding, shadow update). Each count runs in a fresh process; the
figure is the rise of the process' peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the round) during the round, so the encoded replies
themselves (inputs that arrive over the network) are not counted.

    python -m simulations.bench_server_memory            # 4, 16, 64 replies
    python -m simulations.bench_server_memory --counts 4 8

The last line reads ``peak server bytes: 4 replies A, 16 replies B, 64 replies C (ratio
64/4 R)``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MB = 1024 * 1024


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(count: int) -> dict[str, float]:
    """Aggregate ``count`` replies in this process; return bytes and seconds."""
    import time

    import torch

    from fedddl.compression import encode_update, get_compressor
    from fedddl.compression.algorithms.identity import IdentityCompressor
    from fedddl.models import create_model
    from fedddl.running_stats import batchnorm_layers
    from fedddl.sync import ClientReply, ReplicaServer
    from fedddl.sync.messages import fingerprint_prefix

    torch.set_num_threads(1)
    model_fn = lambda: create_model("cifar10", seed=0, arch="resnet18")  # noqa: E731
    server = ReplicaServer(model_fn, compressor="ternary-base3")
    model = server.shadow.model
    gen = torch.Generator().manual_seed(0)
    gradient = {
        n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in model.named_parameters()
    }
    stats = {}
    for name, layer in batchnorm_layers(model).items():
        c = layer.num_features
        stats |= {
            f"{name}.mean": torch.zeros(c),
            f"{name}.var": torch.ones(c),
            f"{name}.count": torch.tensor([1024.0]),
        }
    encoded_stats = encode_update(stats, IdentityCompressor())
    fingerprint = fingerprint_prefix(server.shadow.fingerprint()).hex()
    server.plan_round(1, range(count))
    replies = [
        ClientReply(
            node_id=i,
            model_version=0,
            fingerprint=fingerprint,
            payload=encode_update(gradient, get_compressor("ternary-base3", seed=i)),
            num_examples=32,
            loss=1.0,
            statistics=encoded_stats,
        )
        for i in range(count)
    ]
    del gradient
    encoded = sum(len(r.payload or b"") for r in replies)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _vm("VmRSS")
    start = time.perf_counter()
    report = server.aggregate(1, replies)
    seconds = time.perf_counter() - start
    peak = _vm("VmHWM")
    if len(report.accepted) != count:
        raise RuntimeError(f"only {len(report.accepted)} of {count} replies accepted")
    return {"count": count, "peak_bytes": peak - before, "encoded_bytes": encoded, "s": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[4, 16, 64],
                        help="numbers of replies to aggregate (default: 4 16 64)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.child)))
        return 0
    rows = []
    for count in args.counts:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(count)],
            check=True, capture_output=True, text=True,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{count:3d} replies: peak rise {row['peak_bytes'] / MB:7.1f} MiB during the round "
            f"(encoded replies held: {row['encoded_bytes'] / MB:6.1f} MiB, not counted), "
            f"aggregate {row['s']:.2f} s",
            flush=True,
        )
    parts = ", ".join(f"{r['count']} replies {r['peak_bytes'] / MB:.1f} MiB" for r in rows)
    ratio = rows[-1]["peak_bytes"] / rows[0]["peak_bytes"]
    print(f"peak server bytes: {parts} (ratio {rows[-1]['count']}/{rows[0]['count']} {ratio:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
