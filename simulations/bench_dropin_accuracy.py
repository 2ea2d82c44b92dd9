"""Accuracy and bytes of the drop-in layer on a Flower-quickstart app: plain vs ``TernaryDelta``.

The app is ``docs/examples/quickstart-compressed`` (Flower's PyTorch quickstart ``Net``
and SGD training, Fashion-MNIST padded to 3x32x32, stratified shards), run on the inline
engine (:class:`fedddl.flower.inline_grid.InlineGrid`: replies in a fixed order, so a run
replays exactly). For each seed, local-epochs setting and strategy, every variant runs the
same rounds from the same initial model, with the same sampled nodes each round:

* ``plain``: the Flower strategy as it is, no mod;
* ``dropin``: ``ternary_mod`` + ``TernaryDelta(strategy)``;
* ``dropin:KEY=VALUE;...``: ``TernaryDelta(strategy, KEY=VALUE, ...)`` (``true``/``false``,
  numbers and names are parsed), e.g. ``dropin:downlink=false`` (exact model down);
  ``threshold=T`` / ``min_numel=N`` register the variant's compressor with that cut or
  that size below which a tensor travels dense (see
  :class:`~fedddl.compression.TernaryCompressor`) under ``NAME@...``.

It prints the central test accuracy at ``--report-rounds``, the difference to plain at the
first of them and averaged over rounds 1-6 (``d1-6``), and the ratios of the bytes up
and down (serialized ``RecordDict`` sizes, :class:`fedddl.flower.grid.CountingGrid`) of
plain to the variant over rounds 2 to the end, per seed and their mean, and writes every
round's figures to ``--out`` (JSON). Also recorded per round of a drop-in run: the gap
between the model the clients hold and the exact global model (its L2 norm, relative to
the last round's step of the global model). ``--baseline`` takes the plain runs of earlier
``--out`` files with the same settings (cut to ``--rounds``) instead of running them again.

    python -m simulations.bench_dropin_accuracy --strategies fedavg --epochs 1,3 \\
        --seeds 0,1,2 --rounds 15 --samples 1000
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import random
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "quickstart-compressed"
_TASK = "quickstart_compressed_task"


def load_task() -> ModuleType:
    """The example app's ``task`` module, loaded from its file (it imports only fedddl)."""
    if _TASK in sys.modules:
        return sys.modules[_TASK]
    path = EXAMPLE / "quickstart_compressed" / "task.py"
    spec = importlib.util.spec_from_file_location(_TASK, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_TASK] = module
    spec.loader.exec_module(module)
    return module


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_variant(spec: str) -> dict[str, Any] | None:
    """``None`` for ``plain``; the ``TernaryDelta`` keyword arguments of a ``dropin`` spec."""
    if spec == "plain":
        return None
    name, _, options = spec.partition(":")
    if name != "dropin":
        raise ValueError(f"unknown variant {spec!r}: plain or dropin[:KEY=VALUE;...]")
    kwargs: dict[str, Any] = {}
    for item in filter(None, options.split(";")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant option {item!r} is not KEY=VALUE")
        kwargs[key.strip()] = _value(value.strip())
    return kwargs


def _with_options(compressor: str | None, options: dict[str, Any]) -> str:
    """Register ``compressor`` (default: TernaryDelta's) with other ``threshold`` /
    ``min_numel`` settings, under ``NAME@KEY=VALUE,...``."""
    import inspect

    from fedddl.compression import make_compressor, register_compressor
    from fedddl.flower import TernaryDelta

    base = compressor or inspect.signature(TernaryDelta).parameters["compressor"].default
    name = base + "@" + ",".join(f"{k}={v}" for k, v in sorted(options.items()))

    def factory(**kwargs: Any) -> Any:
        seed, clip_sigma = kwargs.pop("seed", 0), kwargs.pop("clip_sigma", 2.5)
        made = make_compressor(base, seed=seed, clip_sigma=clip_sigma, **kwargs)
        for key, value in options.items():
            setattr(made, key, type(getattr(made, key))(value))
        return made

    register_compressor(name, factory, overwrite=True)
    return name


def _strategy(name: str, fraction: float) -> Any:
    from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg

    kinds = {"fedavg": FedAvg, "fedmedian": FedMedian, "fedtrimmedavg": FedTrimmedAvg}
    return kinds[name](fraction_train=fraction, fraction_evaluate=0.0, min_available_nodes=2)


def run_one(
    strategy_name: str, variant: str, *, seed: int, epochs: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One run; per round: accuracy, bytes down/up, the broadcast gap."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from torch.utils.data import DataLoader, TensorDataset

    from fedddl.flower import TernaryDelta, ternary_mod
    from fedddl.flower.grid import CountingGrid
    from fedddl.flower.inline_grid import InlineGrid

    task = load_task()
    Net, partition, train = task.Net, task.partition, task.train
    kwargs = parse_variant(variant)
    options = {k: kwargs.pop(k) for k in ("threshold", "min_numel") if k in (kwargs or {})}
    if kwargs is not None and options:
        kwargs["compressor"] = _with_options(kwargs.get("compressor"), options)
    app = ClientApp(mods=[] if kwargs is None else [ternary_mod])
    data = {i: partition(i, args.clients, args.samples) for i in range(args.clients)}

    @app.train()
    def train_fn(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        pid = int(context.node_config["partition-id"])
        x, y = data[pid]
        config = msg.content["config"]
        server_round = int(config["server-round"])  # type: ignore[index, arg-type]
        generator = torch.Generator().manual_seed(seed * 1_000_003 + 1000 * server_round + pid)
        loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=generator)
        loss = train(model, loader, epochs, float(config["lr"]), torch.device("cpu"))  # type: ignore[index, arg-type]
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)}),
            }
        )
        return Message(content=content, reply_to=msg)

    strategy = _strategy(strategy_name, args.fraction)
    if kwargs is not None:
        strategy = TernaryDelta(strategy, **kwargs)
    grid = CountingGrid(InlineGrid(app, args.clients))
    testloader = task.load_centralized_dataset(args.test_samples)
    rounds: list[dict[str, Any]] = []
    previous: dict[str, torch.Tensor] = {}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net()
        state = arrays.to_torch_state_dict()
        model.load_state_dict(state)
        loss, accuracy = task.test(model, testloader, torch.device("cpu"))
        entry: dict[str, Any] = {"round": server_round, "accuracy": accuracy, "loss": loss}
        if server_round > 0:
            entry.update(down=grid.bytes_down, up=grid.bytes_up, replies=grid.messages_up)
            grid.reset()
        broadcast = getattr(strategy, "broadcast", None)
        if broadcast is not None and broadcast.floats and previous:
            # the model the clients trained on this round against the global model it stands for
            gap = math.sqrt(sum(float((broadcast.floats[n] - broadcast.exact[n]).square().sum())
                                for n in broadcast.floats))  # fmt: skip
            step = math.sqrt(sum(float((state[n] - previous[n]).square().sum()) for n in previous))
            entry.update(gap=gap, step=step)
        previous.clear()
        previous.update({n: t.clone() for n, t in state.items()})
        rounds.append(entry)
        return MetricRecord({"accuracy": accuracy})

    random.seed(seed)  # Flower samples nodes with the random module
    torch.manual_seed(seed)
    initial = ArrayRecord(Net().state_dict())
    start = time.process_time()
    strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=args.rounds,
        train_config=ConfigRecord({"lr": args.lr}),
        evaluate_fn=evaluate,
    )
    return {
        "strategy": strategy_name, "variant": variant, "seed": seed, "epochs": epochs,
        "cpu_s": time.process_time() - start, "rounds": rounds,
        "dropped": dict(getattr(strategy, "dropped", {})),
    }  # fmt: skip


def _bytes_ratio(plain: dict[str, Any], run: dict[str, Any], key: str) -> float:
    """Plain bytes over the run's, summed over rounds 2 to the end."""
    p = sum(r[key] for r in plain["rounds"][2:])
    q = sum(r[key] for r in run["rounds"][2:])
    return p / q if q else float("nan")


def _early_lag(plain: dict[str, Any], run: dict[str, Any]) -> float:
    """The run's accuracy minus plain's, averaged over rounds 1 to 6."""
    pairs = list(zip(plain["rounds"][1:7], run["rounds"][1:7], strict=False))
    return sum(r["accuracy"] - p["accuracy"] for p, r in pairs) / max(len(pairs), 1)


def _accuracy(run: dict[str, Any], at: int) -> float:
    return run["rounds"][at]["accuracy"] if at < len(run["rounds"]) else float("nan")


def table(results: list[dict[str, Any]], report: list[int]) -> str:
    """Accuracy at the report rounds and bytes ratios, per seed and mean, side by side."""
    lines = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in results:
        groups.setdefault((run["strategy"], run["epochs"]), []).append(run)
    for (strategy, epochs), runs in groups.items():
        lines.append(f"\n{strategy}, local epochs {epochs}")
        head = " ".join(f"acc@{r:<3}" for r in report)
        lines.append(f"  {'variant':<44} {'seed':>4} {head}  d@{report[0]:<3} d1-6   up-x  down-x")
        plain = {r["seed"]: r for r in runs if r["variant"] == "plain"}
        variants = list(dict.fromkeys(r["variant"] for r in runs))
        for variant in variants:
            rows = [r for r in runs if r["variant"] == variant]
            stats = []
            for run in rows:
                accs = [_accuracy(run, at) for at in report]
                base = plain.get(run["seed"])
                diff = accs[0] - _accuracy(base, report[0]) if base else float("nan")
                early = _early_lag(base, run) if base else float("nan")
                up = _bytes_ratio(base, run, "up") if base else float("nan")
                down = _bytes_ratio(base, run, "down") if base else float("nan")
                stats.append((accs, diff, early, up, down))
                cells = " ".join(f"{a:7.4f}" for a in accs)
                lines.append(f"  {variant:<44} {run['seed']:>4} {cells} {diff:+6.3f} "
                             f"{early:+6.3f} {up:5.1f} {down:6.1f}")  # fmt: skip
            if len(rows) > 1:
                mean = [sum(s[0][i] for s in stats) / len(stats) for i in range(len(report))]
                cells = " ".join(f"{a:7.4f}" for a in mean)
                m = [sum(s[k] for s in stats) / len(stats) for k in (1, 2, 3, 4)]
                lines.append(f"  {variant:<44} {'mean':>4} {cells} {m[0]:+6.3f} "
                             f"{m[1]:+6.3f} {m[2]:5.1f} {m[3]:6.1f}")  # fmt: skip
        for variant in variants:
            if variant != "plain":
                lines.append(f"  mean difference to plain, {variant}: " + " ".join(
                    f"r{at} {_mean_diff(runs, variant, at):+.4f}" for at in report))  # fmt: skip
    return "\n".join(lines)


def _mean_diff(runs: list[dict[str, Any]], variant: str, at: int) -> float:
    plain = {r["seed"]: r for r in runs if r["variant"] == "plain"}
    diffs = [_accuracy(r, at) - _accuracy(plain[r["seed"]], at)
             for r in runs if r["variant"] == variant and r["seed"] in plain]  # fmt: skip
    return sum(diffs) / len(diffs) if diffs else float("nan")


#: Settings a saved plain run must share with this command to stand in for its plain variant.
SAME_SETTINGS = ("clients", "fraction", "samples", "test_samples", "lr")


def load_baselines(
    paths: list[str], args: argparse.Namespace
) -> dict[tuple[str, int, int], dict[str, Any]]:
    """``(strategy, epochs, seed) -> plain run`` from ``--out`` files of earlier commands
    with the same settings and at least ``args.rounds`` rounds (cut to them)."""
    found: dict[tuple[str, int, int], dict[str, Any]] = {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        if any(saved["args"].get(k) != getattr(args, k) for k in SAME_SETTINGS):
            continue
        for run in saved["results"]:
            if run["variant"] == "plain" and len(run["rounds"]) > args.rounds:
                cut = dict(run, rounds=run["rounds"][: args.rounds + 1], baseline=path)
                found.setdefault((run["strategy"], run["epochs"], run["seed"]), cut)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="fedavg,fedmedian,fedtrimmedavg")
    parser.add_argument("--variants", default="plain,dropin",
                        help="comma-separated: plain, dropin, dropin:KEY=VALUE;...")  # fmt: skip
    parser.add_argument("--epochs", default="1,3", help="local epochs settings (default: 1,3)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--report-rounds", default="5,15,50")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.5, help="fraction-train")
    parser.add_argument("--samples", type=int, default=1000, help="training images per client")
    parser.add_argument("--test-samples", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", default="", help="JSON file for every round's figures")
    parser.add_argument("--baseline", default="",
                        help="comma-separated JSON files of earlier runs (--out) whose plain "
                        "runs of the same settings stand in for the plain variant")  # fmt: skip
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    report = [r for r in (int(x) for x in args.report_rounds.split(",")) if r <= args.rounds]
    report = report if args.rounds in report else [*report, args.rounds]
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower's per-round log
    results = []
    saved = load_baselines(args.baseline.split(","), args) if args.baseline else {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for epochs in (int(e) for e in args.epochs.split(",")):
            for strategy in args.strategies.split(","):
                for variant in args.variants.split(","):
                    if variant == "plain" and (strategy, epochs, seed) in saved:
                        results.append(saved[strategy, epochs, seed])
                        continue
                    run = run_one(strategy, variant, seed=seed, epochs=epochs, args=args)
                    results.append(run)
                    last = run["rounds"][-1]["accuracy"]
                    print(f"{strategy} E{epochs} seed {seed} {variant}: accuracy {last:.4f} "
                          f"({run['cpu_s']:.0f} CPU s)", flush=True)  # fmt: skip
                    if args.out:
                        Path(args.out).write_text(json.dumps(
                            {"args": vars(args), "results": results}, indent=1))  # fmt: skip
    print(table(results, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
