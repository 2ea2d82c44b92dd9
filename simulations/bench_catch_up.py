"""Bytes of a catch-up over K missed rounds: one grid count delta vs K ternary messages vs fp32.

Trains the digits MLP for ``--rounds`` rounds on a real gradient stream: each round
``--sampled`` of ``--clients`` stratified shards send a TernGrad-coded minibatch gradient,
the server averages them, keeps momentum and asks for the step ``x = -lr * momentum``. The
step goes onto the integer grid (:class:`fedddl.sync.grid_quantizer.GridQuantizer`,
ternary codes, error feedback; a rebase only when the counts would overflow) and into a
:class:`fedddl.sync.grid_log.GridLog`. From round ``--from-round`` on, every 10 rounds, it
encodes for each ``K`` in ``--behind``:

* ``grid``: the catch-up from ``K`` rounds back, one message
  (:func:`fedddl.compression.codecs.counts.encode_counts`);
* ``base3 x K``: the ``K`` rounds' steps as ``K`` separate ternary messages
  (``encode_update`` with ``TernaryCompressor(codec="base3")``), and ``entropy x K`` the same
  with ``TernaryEntropyCompressor`` (zstd);
* ``fp32``: the model as one fp32 message (``IdentityCompressor``), and the server's counts
  since the last rebase as one count delta (all a client needs that holds the anchor).

It prints the mean bytes of each, bits a value, and ratios, and the test accuracy of the
grid-trained model next to the same stream applied in fp32. A replica that applies the
catch-up is checked to equal the server's grid state bit for bit.

    python -m simulations.bench_catch_up
"""

from __future__ import annotations

import argparse
import dataclasses
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="rounds (default: 200)")
    parser.add_argument("--clients", type=int, default=100, help="shards (default: 100)")
    parser.add_argument("--sampled", type=int, default=10, help="clients a round (default: 10)")
    parser.add_argument(
        "--behind", default="1,2,5,10,20,40", help="K values (default: 1,2,5,10,20,40)"
    )
    parser.add_argument(
        "--from-round", type=int, default=60, help="first measured round (default: 60)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    args = parser.parse_args(argv)
    behind = [int(k) for k in args.behind.split(",")]
    if args.from_round <= max(behind) or args.from_round > args.rounds:
        parser.error("--from-round must exceed every K and be at most --rounds")

    import numpy as np
    import torch

    from fedddl.app_config import AppConfig
    from fedddl.compression import (
        IdentityCompressor,
        ResidualMemory,
        TernaryCompressor,
        TernaryEntropyCompressor,
        decode_update,
        encode_update,
    )
    from fedddl.compression.codecs.count_delta import CountDelta
    from fedddl.compression.codecs.counts import decode_counts, encode_counts
    from fedddl.data import as_tensors, get_labels, load_dataset
    from fedddl.partition import stratified_shards
    from fedddl.sync.grid import GridState
    from fedddl.sync.grid_log import GridLog
    from fedddl.sync.grid_quantizer import GridQuantizer

    torch.set_num_threads(1)
    started = time.perf_counter()
    train, test = load_dataset("digits", split="train"), load_dataset("digits", split="test")
    (x_train, y_train), (x_test, y_test) = as_tensors(train), as_tensors(test)
    shards = stratified_shards(get_labels(train), args.clients, seed=args.seed)
    build = AppConfig(seed=args.seed).model_factory()
    grid_model, exact_model = build(), build()
    names = [name for name, _ in grid_model.named_parameters()]
    numel = sum(p.numel() for p in grid_model.parameters())
    state = GridState(dict(grid_model.named_parameters()))
    quantizer, log = GridQuantizer(1, seed=args.seed), GridLog(max(behind), version=0)
    history: dict[int, GridState] = {0: state.copy()}
    momentum = {n: torch.zeros_like(p) for n, p in grid_model.named_parameters()}
    exact_momentum = {n: torch.zeros_like(p) for n, p in exact_model.named_parameters()}
    uplink = TernaryCompressor(seed=args.seed)
    rng = np.random.default_rng(args.seed)
    baselines = {
        "base3": (TernaryCompressor(codec="base3", seed=args.seed), ResidualMemory()),
        "entropy": (TernaryEntropyCompressor(seed=args.seed), ResidualMemory()),
    }
    per_round: dict[str, dict[int, int]] = {key: {} for key in baselines}
    sizes: dict[str, dict[int, list[float]]] = {
        key: {k: [] for k in behind} for key in ("grid", "entropy of counts", *baselines)
    }
    snapshot: list[int] = []
    since_rebase: list[int] = []
    rebases = 0

    def gradient(model: torch.nn.Module, client: int, round_: int) -> dict[str, torch.Tensor]:
        pick = np.random.default_rng((args.seed, round_, client)).choice(
            shards[client], min(32, len(shards[client])), replace=False
        )
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x_train[pick]), y_train[pick]).backward()
        return {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }

    def accuracy(model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float((model(x_test).argmax(1) == y_test).float().mean())

    for t in range(1, args.rounds + 1):
        chosen = rng.choice(args.clients, size=args.sampled, replace=False)
        for model, buffers, exact in (
            (grid_model, momentum, False),
            (exact_model, exact_momentum, True),
        ):
            mean = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            for client in chosen:
                coded = decode_update(encode_update(gradient(model, int(client), t), uplink))
                for n in names:
                    mean[n] += coded[n] / args.sampled
            for n in names:
                buffers[n].mul_(0.9).add_(mean[n])
            step = {n: -0.1 * buffers[n] for n in names}
            if exact:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.add_(step[n])
                continue
            update = quantizer.quantize(t, step)
            if state.needs_rebase(update):
                update, rebases = dataclasses.replace(update, rebase=True), rebases + 1
            state.apply(update)
            log.append(t, update)
            for key, (compressor, memory) in baselines.items():
                per_round[key][t] = len(encode_update(step, compressor, memory))
            history[t] = state.copy()
            history.pop(t - max(behind) - 1, None)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(state.tensors[n].value())
        if t < args.from_round or (t - args.from_round) % 10:
            continue
        snapshot.append(len(encode_update(state.values(), IdentityCompressor())))
        since_rebase.append(len(encode_counts(CountDelta(0, t, (state.snapshot_segment(),)))))
        for k in behind:
            delta = log.catch_up(t - k)
            assert delta is not None
            data = encode_counts(delta)
            replica = history[t - k].copy()
            replica.apply_catch_up(decode_counts(data, state.layout, 1 << 24))
            assert all(
                torch.equal(a, b)
                for a, b in zip(replica.values().values(), state.values().values(), strict=True)
            )
            sizes["grid"][k].append(len(data))
            for key in baselines:
                sizes[key][k].append(sum(per_round[key][u] for u in range(t - k + 1, t + 1)))
            values = torch.cat([d.reshape(-1) for s in delta.segments for d in s.deltas.values()])
            _, counts = np.unique(values.numpy(), return_counts=True)
            frequency = counts / counts.sum()
            bits = float(-(frequency * np.log2(frequency)).sum()) * len(values)
            sizes["entropy of counts"][k].append(bits / 8)

    fp32 = float(np.mean(snapshot))
    print(
        f"digits MLP, {numel} parameters, {args.rounds} rounds, "
        f"{args.sampled}/{args.clients} clients a round, "
        f"seed {args.seed}; catch-ups measured at rounds {args.from_round}..{args.rounds} every 10 "
        f"({len(snapshot)} points); {rebases} rebases"
    )
    print(f"fp32 snapshot: {fp32:,.0f} bytes ({fp32 * 8 / numel:.2f} bits/value)")
    counts = float(np.mean(since_rebase))
    print(
        f"counts since the last rebase (a client that holds the anchor, e.g. the seeded initial "
        f"model when nothing rebased): {counts:,.0f} bytes ({counts / fp32:.3f} x fp32)"
    )
    print(
        f"{'K':>3} | {'grid B':>7} {'bits/val':>8} {'H bits':>6} {'x fp32':>6} | "
        f"{'base3 x K':>9} {'x fp32':>6} | {'entropy x K':>11} {'x fp32':>6} | "
        f"{'base3/grid':>10} {'entropy/grid':>12}"
    )
    for k in behind:
        g, h, b, e = (
            float(np.mean(sizes[key][k])) for key in ("grid", "entropy of counts", *baselines)
        )
        print(
            f"{k:>3} | {g:>7,.0f} {g * 8 / numel:>8.2f} {h * 8 / numel:>6.2f} {g / fp32:>6.3f} | "
            f"{b:>9,.0f} {b / fp32:>6.3f} | {e:>11,.0f} {e / fp32:>6.3f} | "
            f"{b / g:>10.1f} {e / g:>12.1f}"
        )
    print(
        f"test accuracy after {args.rounds} rounds: grid {accuracy(grid_model):.4f}, "
        f"same stream in fp32 {accuracy(exact_model):.4f}"
    )
    print(f"runtime {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
