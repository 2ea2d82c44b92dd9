"""Per-round results of a run: server-side evaluation, bytes each way, replica agreement.

:class:`RoundRecorder` is passed to ``Strategy.start`` as ``evaluate_fn``: Flower calls it
before the first round and after every round. A replica-keeping strategy (the TernGrad
family) is evaluated on its global model directly (``global_model``, no copy); any other
strategy on the arrays Flower passes (FedAvg's averaged weights), loaded into a model.

Evaluation runs every ``eval_every`` rounds and after the last one (rounds in between
record ``accuracy = loss = None``), on ``eval_samples`` test examples (a seeded random
subset; all when 0).

In a run resumed from a checkpoint Flower counts rounds from 1 again; ``round_offset``
(the checkpoint's round) makes the records, the progress line and the ``on_round`` hook use
the global round number. ``on_round`` (e.g. the ServerApp's checkpoint saver) is called
with the global round after each round is recorded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from logging import INFO
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import log
from torch import nn

from fedddl.flower.grid import CountingGrid
from fedddl.progress import report as report_progress
from fedddl.sync.report import RoundReport

__all__ = ["RoundRecorder", "evaluation_subset"]


def evaluation_subset(
    x: torch.Tensor, y: torch.Tensor, samples: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` examples drawn without replacement with ``seed`` (all when 0 or more)."""
    if samples <= 0 or samples >= x.shape[0]:
        return x, y
    index = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:samples]
    return x[index], y[index]


class RoundRecorder:
    """Evaluate the shared model each round and collect the round records.

    Parameters
    ----------
    model_fn : Callable[[], torch.nn.Module]
        Builds a model to load Flower's arrays into (strategies without a global model).
    x_test, y_test : torch.Tensor
        Held-out split (or the subset to evaluate on).
    grid : CountingGrid
        Source of the byte counts (reset after every round).
    round_report : Callable[[], RoundReport | None] | None
        The strategy's report of the latest round (replica-keeping strategies), else None.
    num_rounds : int
        The run's total, global rounds (the last one is always evaluated).
    progress : Callable[[str], None] | None
        Called with a one-line summary per round (default: Flower's logger).
    round_offset : int
        Added to Flower's round number (rounds completed before a resume).
    on_round : Callable[[int], None] | None
        Called with the global round number after each round has been recorded.
    attackers : frozenset[int]
        Attack evaluation: the attacking nodes. Each round then also records the bytes to
        and from them and ``replicas_equal_honest`` (the fingerprints of the other nodes).
    global_model : Callable[[], torch.nn.Module] | None
        The strategy's global model, evaluated in place of Flower's arrays.
    eval_every : int
        Evaluate every ``eval_every`` rounds (and the last round).
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        x_test: torch.Tensor,
        y_test: torch.Tensor,
        grid: CountingGrid,
        round_report: Callable[[], RoundReport | None] | None,
        num_rounds: int,
        progress: Callable[[str], None] | None = None,
        round_offset: int = 0,
        on_round: Callable[[int], None] | None = None,
        attackers: frozenset[int] = frozenset(),
        global_model: Callable[[], nn.Module] | None = None,
        eval_every: int = 1,
    ) -> None:
        if round_offset < 0:
            raise ValueError(f"round_offset must be >= 0, got {round_offset}")
        if eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {eval_every}")
        self.model_fn = model_fn
        self.model: nn.Module | None = None
        self.global_model = global_model
        self.eval_every = eval_every
        self.round_offset = round_offset
        self.on_round = on_round
        self.attackers = attackers
        self.x_test, self.y_test = x_test, y_test
        self.grid = grid
        self.round_report = round_report
        self.num_rounds = num_rounds
        self.progress = progress or (lambda line: log(INFO, "%s", line))
        self.rounds: list[dict[str, Any]] = []
        self.initial: dict[str, float] = {}
        self._mark = time.perf_counter()

    def _evaluate(self, arrays: ArrayRecord) -> tuple[float, float]:
        from fedddl.training import evaluate

        if self.global_model is not None:
            model = self.global_model()
        else:
            if self.model is None:
                self.model = self.model_fn()
            self.model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
            model = self.model
        return evaluate(model, self.x_test, self.y_test)

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Record round ``server_round`` (0 = initial model) and return its metrics."""
        wall = time.perf_counter() - self._mark
        global_round = server_round + self.round_offset
        if server_round == 0:
            loss, acc = self._evaluate(arrays)
            self.initial = {"accuracy": acc, "loss": loss}
            self.grid.reset()
            self._mark = time.perf_counter()
            return MetricRecord({"accuracy": acc, "loss": loss})
        due = global_round % self.eval_every == 0 or global_round >= self.num_rounds
        loss_or_none, acc_or_none = self._evaluate(arrays) if due else (None, None)
        report = None if self.round_report is None else self.round_report()
        record: dict[str, Any] = {
            "round": global_round,
            "accuracy": acc_or_none,
            "loss": loss_or_none,
            "bytes_up": self.grid.bytes_up,
            "bytes_down": self.grid.bytes_down,
            "messages_up": self.grid.messages_up,
            "messages_down": self.grid.messages_down,
            "replicas_equal": None if report is None else report.replicas_equal,
            "wall_s": wall,
            "started_at": time.time() - wall,  # Unix time: for the testbed's activity samples
            "exchange_s": self.grid.exchange_s,
            "count_s": self.grid.count_s,
            "client_s_sum": self.grid.client_s,
        }
        if self.grid.client_cached_max is not None:
            record["client_cached_max"] = self.grid.client_cached_max
        if report is not None:
            record.update(
                {
                    "train_loss": None if math.isnan(report.loss) else report.loss,
                    "model_version": report.version,
                    "accepted": len(report.accepted),
                    "dropped": {str(k): v for k, v in report.dropped.items()},
                    "clipped": {str(k): v for k, v in report.clipped.items()},
                    "mismatched": list(report.mismatched),
                    "resync_limited": list(report.resync_limited),
                    "downlink_format": report.downlink_format,
                    "aggregate_s": report.aggregate_s,
                    "skipped": report.skipped,
                    "skip_reason": report.skip_reason,
                }
            )
        if self.attackers:
            down, up = self.grid.bytes_down_by_node, self.grid.bytes_up_by_node
            record["bytes_down_attackers"] = sum(down.get(n, 0) for n in self.attackers)
            record["bytes_up_attackers"] = sum(up.get(n, 0) for n in self.attackers)
            if report is not None:
                record["replicas_equal_honest"] = report.replicas_equal_without(
                    set(self.attackers)
                )
        self.rounds.append(record)
        agree = {True: "yes", False: "NO", None: "n/a"}[record["replicas_equal"]]
        scores = "" if acc_or_none is None else f"acc={acc_or_none:.4f} loss={loss_or_none:.4f} "
        report_progress(
            self.progress,
            f"round {global_round}/{self.num_rounds}: {scores}"
            f"up={record['bytes_up']}B down={record['bytes_down']}B replicas-equal={agree} "
            f"wall={wall:.3f}s",
            done=global_round,
        )
        if self.on_round is not None:
            self.on_round(global_round)
        self.grid.reset()
        self._mark = time.perf_counter()
        if acc_or_none is None or loss_or_none is None:
            return None
        return MetricRecord({"accuracy": acc_or_none, "loss": loss_or_none})
