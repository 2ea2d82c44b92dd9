"""What BatchNorm's running statistics cost a run's accuracy: ``fedddl simulate`` with a second
score at every evaluation.

Runs ``fedddl simulate`` with the arguments given (in this process) and, at every evaluation
of a model with BatchNorm layers, also scores a copy whose running statistics are recomputed
at its current weights: the copy's statistics are reset, then it sees ``--calibration``
training images (a seeded draw, 64 a batch) in training mode with a cumulative average
(``momentum=None``). The run itself is unchanged (the copy is thrown away). Each evaluation
prints one ``BN-LAG`` line; ``--lag-out FILE`` writes them as JSON (per evaluation: ``acc``,
``loss`` with the replica's statistics, ``recal_acc``, ``recal_loss`` with recomputed ones).
``--momenta 0.1,0.3`` also scores, at every evaluation, the same weights with the running
statistics a run with each of those ``bn-momentum`` values would have
(:mod:`simulations.bn_momenta`; per evaluation ``acc_at`` and ``loss_at``, by momentum).

    python -m simulations.bn_lag --lag-out lag.json -- simulate --engine inline \\
        --dataset fashion-mnist --arch resnet8 --num-clients 100 --fraction-train 0.1 \\
        --rounds 60 --eval-every 10 --eval-samples 2000 --seed 0
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from simulations.bn_momenta import SideMomenta

_BATCH = 64


def recalibrated(model: nn.Module, images: torch.Tensor) -> nn.Module:
    """A copy of ``model`` whose BatchNorm running statistics are the cumulative average over
    ``images`` (in batches of 64, training mode, no gradients)."""
    work = copy.deepcopy(model)
    for module in work.modules():
        if isinstance(module, _BatchNorm):
            module.reset_running_stats()
            module.momentum = None
    work.train()
    with torch.no_grad():
        for start in range(0, images.shape[0], _BATCH):
            work(images[start : start + _BATCH])
    return work


def _calibration_images(dataset: str, count: int, seed: int) -> torch.Tensor:
    from fedddl.data import load_dataset

    data = load_dataset(dataset, split="train")
    images = getattr(data, "images", None)
    if not isinstance(images, torch.Tensor):
        raise SystemExit(f"{dataset}: needs an in-memory dataset")
    index = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(seed))
    return images[index[:count]].float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dataset", default="fashion-mnist", help="calibration images' dataset")
    parser.add_argument(
        "--calibration", type=int, default=2048, help="training images (0: no recomputed score)"
    )
    parser.add_argument("--calibration-seed", type=int, default=123)
    parser.add_argument("--lag-out", default="", help="JSON file of the BN-LAG lines")
    parser.add_argument(
        "--momenta", default="", help="comma-separated BatchNorm momenta also scored (side copies)"
    )
    parser.add_argument("fedddl_args", nargs=argparse.REMAINDER, help="-- simulate ...")
    args = parser.parse_args(argv)
    rest = (
        [a for a in args.fedddl_args if a != "--"]
        if args.fedddl_args[:1] == ["--"]
        else list(args.fedddl_args)
    )
    torch.set_num_threads(1)
    import fedddl.training as training

    plain = training.evaluate
    calibration: list[torch.Tensor] = []
    records: list[dict[str, object]] = []
    sides = SideMomenta([float(m) for m in args.momenta.split(",") if m.strip()])
    if sides.momenta:
        import fedddl.replica as replica
        import fedddl.sync.grid_shadow as grid_shadow

        replica.apply_statistics = sides.wrap(replica.apply_statistics)  # type: ignore[assignment]
        grid_shadow.apply_statistics = sides.wrap(grid_shadow.apply_statistics)  # type: ignore[assignment]

    def evaluate(
        model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
    ) -> tuple[float, float]:
        loss, acc = plain(model, x, y, batch_size)
        if any(isinstance(m, _BatchNorm) for m in model.modules()):
            record: dict[str, object] = {"acc": acc, "loss": loss}
            recal_acc = recal_loss = float("nan")
            if args.calibration > 0:
                if not calibration:
                    calibration.append(
                        _calibration_images(args.dataset, args.calibration, args.calibration_seed)
                    )
                recal = recalibrated(model, calibration[0])
                recal_loss, recal_acc = plain(recal, x, y, batch_size)
                record.update(recal_acc=recal_acc, recal_loss=recal_loss)
            at = {  # before the first statistics update every side is the model itself
                m: plain(sides.with_statistics_of(model, m), x, y, batch_size)
                if sides.updates
                else (loss, acc)
                for m in sides.momenta
            }
            if at:
                record["acc_at"] = {str(m): a for m, (_, a) in at.items()}
                record["loss_at"] = {str(m): v for m, (v, _) in at.items()}
                record["statistics_updates"] = sides.updates
            records.append(record)
            print(
                f"BN-LAG acc={acc:.4f} loss={loss:.3f} recalibrated acc={recal_acc:.4f} "
                f"loss={recal_loss:.3f}" + "".join(f" m={m}:{a:.4f}" for m, (_, a) in at.items()),
                flush=True,
            )
        return loss, acc

    training.evaluate = evaluate  # the recorder imports it at each evaluation
    from fedddl.cli import main as fedddl_main

    code = fedddl_main(rest)
    if args.lag_out:
        with open(args.lag_out, "w", encoding="utf-8") as out:
            json.dump(records, out, indent=1)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
