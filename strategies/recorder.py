"""Per-round results of a run: server-side evaluation, bytes each way, replica agreement.

:class:`RoundRecorder` is passed to ``Strategy.start`` as ``evaluate_fn``: Flower
calls it before the first round and after every round with the current global
arrays (for TernGrad the shadow replica, for FedAvg the averaged weights).

In a run resumed from a checkpoint Flower counts rounds from 1 again;
``round_offset`` (the checkpoint's round) makes the records, the progress line and
the ``on_round`` hook use the global round number. ``on_round`` (e.g. the
ServerApp's checkpoint saver) is called with the global round after each round is
recorded.
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

__all__ = ["RoundRecorder"]


class RoundRecorder:
    """Evaluate the shared model each round and collect the round records.

    Parameters
    ----------
    model_fn : Callable[[], torch.nn.Module]
        Builds a model to load the arrays into.
    x_test, y_test : torch.Tensor
        Held-out split.
    grid : CountingGrid
        Source of the byte counts (reset after every round).
    round_report : Callable[[], RoundReport | None] | None
        The strategy's report of the latest round (replica-keeping strategies), else None.
    num_rounds : int
        For the progress line (the run's total, global rounds).
    progress : Callable[[str], None] | None
        Called with a one-line summary per round (default: Flower's logger).
    round_offset : int
        Added to Flower's round number (rounds completed before a resume).
    on_round : Callable[[int], None] | None
        Called with the global round number after each round has been recorded.
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
    ) -> None:
        if round_offset < 0:
            raise ValueError(f"round_offset must be >= 0, got {round_offset}")
        self.model = model_fn()
        self.round_offset = round_offset
        self.on_round = on_round
        self.x_test, self.y_test = x_test, y_test
        self.grid = grid
        self.round_report = round_report
        self.num_rounds = num_rounds
        self.progress = progress or (lambda line: log(INFO, "%s", line))
        self.rounds: list[dict[str, Any]] = []
        self.initial: dict[str, float] = {}
        self._mark = time.perf_counter()

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Record round ``server_round`` (0 = initial model) and return its metrics."""
        wall = time.perf_counter() - self._mark
        from fedddl.training import evaluate

        self.model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
        loss, acc = evaluate(self.model, self.x_test, self.y_test)
        if server_round == 0:
            self.initial = {"accuracy": acc, "loss": loss}
            self.grid.reset()
            self._mark = time.perf_counter()
            return MetricRecord({"accuracy": acc, "loss": loss})
        report = None if self.round_report is None else self.round_report()
        global_round = server_round + self.round_offset
        record: dict[str, Any] = {
            "round": global_round,
            "accuracy": acc,
            "loss": loss,
            "bytes_up": self.grid.bytes_up,
            "bytes_down": self.grid.bytes_down,
            "messages_up": self.grid.messages_up,
            "messages_down": self.grid.messages_down,
            "replicas_equal": None if report is None else report.replicas_equal,
            "wall_s": wall,
            "exchange_s": self.grid.exchange_s,
            "count_s": self.grid.count_s,
            "client_s_sum": self.grid.client_s,
        }
        if report is not None:
            record.update(
                {
                    "train_loss": None if math.isnan(report.loss) else report.loss,
                    "model_version": report.version,
                    "accepted": len(report.accepted),
                    "dropped": {str(k): v for k, v in report.dropped.items()},
                    "downlink_format": report.downlink_format,
                    "aggregate_s": report.aggregate_s,
                    "skipped": report.skipped,
                }
            )
        self.rounds.append(record)
        agree = {True: "yes", False: "NO", None: "n/a"}[record["replicas_equal"]]
        report_progress(
            self.progress,
            f"round {global_round}/{self.num_rounds}: acc={acc:.4f} loss={loss:.4f} "
            f"up={record['bytes_up']}B down={record['bytes_down']}B replicas-equal={agree} "
            f"wall={wall:.3f}s",
            done=global_round,
        )
        if self.on_round is not None:
            self.on_round(global_round)
        self.grid.reset()
        self._mark = time.perf_counter()
        return MetricRecord({"accuracy": acc, "loss": loss})
