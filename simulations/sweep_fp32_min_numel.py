"""Choose ``fp32-min-numel``: TernGrad's accuracy and bytes for several thresholds, side by side.

Runs TernGrad on the same shards and seeds with each ``--values`` threshold (parameters with
fewer elements travel in fp32), plus GradientAverage (everything in fp32) as the reference,
and prints per setting the final accuracy (mean and range over ``--seeds``), the mean bytes
up per round and which parameters travelled in fp32. The runs use the inline engine of
``fedddl simulate`` (the same ServerApp and ClientApp as on Ray, without Ray, so a run
takes seconds).

    python -m simulations.sweep_fp32_min_numel --dataset digits --arch mlp
    python -m simulations.sweep_fp32_min_numel --dataset digits --arch cnn --rounds 60
    python -m simulations.sweep_fp32_min_numel --dataset fashion-mnist --arch resnet8 \\
        --rounds 60 --seeds 0 --eval-samples 2000

The last line reads ``best: fp32-min-numel=N (accuracy A, bytes up B/round)``: the smallest
threshold whose mean accuracy is within 0.5 points of the best threshold's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="dataset name (default: digits)")
    parser.add_argument("--arch", default="mlp", help="model architecture (default: mlp)")
    parser.add_argument("--rounds", type=int, default=100, help="rounds per run (default: 100)")
    parser.add_argument("--num-clients", type=int, default=10, help="clients (default: 10)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--values", default="0,256,2048",
                        help="comma-separated fp32-min-numel thresholds (default: 0,256,2048)")
    parser.add_argument("--eval-samples", type=int, default=0,
                        help="test samples for the final evaluation (default: 0, all)")
    args = parser.parse_args(argv)

    import torch

    from fedddl.app_config import AppConfig
    from fedddl.flower.simulation import run
    from fedddl.sync.exemptions import exempt_parameters

    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    settings: list[tuple[str, str, int]] = [
        (f"terngrad fp32-min-numel={v}", "terngrad", int(v)) for v in args.values.split(",")
    ]
    settings.append(("gradient-average (all fp32)", "gradient-average", 0))
    rows: dict[str, tuple[list[float], list[float]]] = {}
    for label, strategy, min_numel in settings:
        accs: list[float] = []
        ups: list[float] = []
        for seed in seeds:
            cfg = AppConfig(
                num_server_rounds=args.rounds,
                strategy=strategy,
                dataset=args.dataset,
                arch=args.arch,
                seed=seed,
                fp32_min_numel=min_numel,
                min_available_nodes=args.num_clients,
                eval_every=args.rounds,
                eval_samples=args.eval_samples,
            )
            start = time.perf_counter()
            result = run(cfg, num_clients=args.num_clients, engine="inline", progress=None)
            accs.append(float(result["final_accuracy"]))
            ups.append(float(result["summary"]["mean_bytes_up"]))
            print(f"{label:32s} seed {seed}: accuracy {accs[-1]:.4f}, "
                  f"{ups[-1]:,.0f} B up/round ({time.perf_counter() - start:.0f} s)", flush=True)
        rows[label] = (accs, ups)
        if strategy == "terngrad":
            model = cfg.model_factory()()
            dense = exempt_parameters(model, min_numel=min_numel, logits=cfg.fp32_logits)
            numel = sum(p.numel() for n, p in model.named_parameters() if n in dense)
            total = sum(p.numel() for p in model.parameters())
            print(f"  fp32: {len(dense)} tensors, {numel:,} of {total:,} parameters", flush=True)
    print(f"\n{args.dataset} {args.arch}, {args.num_clients} clients, {args.rounds} rounds, "
          f"seeds {args.seeds}")
    print(f"{'setting':32s} {'accuracy mean [min, max]':>28s} {'bytes up/round':>15s}")
    for label, (accs, ups) in rows.items():
        print(f"{label:32s} {statistics.mean(accs):>10.4f} [{min(accs):.4f}, {max(accs):.4f}] "
              f"{statistics.mean(ups):>15,.0f}")
    tern = {k: v for k, v in rows.items() if k.startswith("terngrad")}
    top = max(statistics.mean(a) for a, _ in tern.values())
    label, (accs, ups) = next(
        (k, v) for k, v in tern.items() if statistics.mean(v[0]) >= top - 0.005
    )
    print(f"best: {label.split()[-1]} (accuracy {statistics.mean(accs):.4f}, "
          f"bytes up {statistics.mean(ups):,.0f}/round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
