"""quickstart_compressed: the quickstart's ServerApp, its FedAvg wrapped in ``TernaryDelta``."""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedddl.flower import TernaryDelta  # fedddl: the strategy wrapper
from fedddl.flower.grid import CountingGrid
from fedddl.flower.records import content_nbytes
from quickstart_compressed.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    torch.set_num_threads(1)
    fraction_train = float(context.run_config["fraction-train"])
    fraction_evaluate = float(context.run_config["fraction-evaluate"])
    num_rounds = int(context.run_config["num-server-rounds"])
    lr = float(context.run_config["lr"])
    test_samples = int(context.run_config["test-samples"])

    torch.manual_seed(0)
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # fedddl: the only change to the strategy is the TernaryDelta(...) around it
    strategy = TernaryDelta(
        FedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate)
    )
    testloader = load_centralized_dataset(test_samples)

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate the global model on the central test set."""
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(model, testloader, torch.device("cpu"))
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    # Optional: log the bytes each exchange sends and receives
    counting = ByteLog(grid, plain=content_nbytes(RecordDict({"arrays": arrays})))
    result = strategy.start(
        grid=counting,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )
    log(INFO, "fedddl: %s", counting.summary())
    accuracy = result.evaluate_metrics_serverapp.get(num_rounds, MetricRecord()).get("accuracy")
    log(INFO, "fedddl: central accuracy after round %s: %s", num_rounds, accuracy)


class ByteLog(CountingGrid):
    """A :class:`CountingGrid` that logs each exchange's bytes against the whole model's.

    ``plain`` is the serialized size of a message that carries the whole model; each line
    compares the bytes sent with that size times the number of messages.
    """

    def __init__(self, inner: Grid, plain: int) -> None:
        super().__init__(inner)
        self.plain = plain
        self.totals = {"down": 0, "up": 0, "messages": 0, "replies": 0}

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Count the exchange, log it, hand the replies on."""
        messages = list(messages)
        self.reset()
        replies = list(super().send_and_receive(messages, timeout=timeout))
        kind = messages[0].metadata.message_type if messages else "nothing"
        trains = kind == "train"
        self.totals["down"] += self.bytes_down
        self.totals["messages"] += self.messages_down
        if trains:  # evaluation replies carry no model
            self.totals["up"] += self.bytes_up
            self.totals["replies"] += len(replies)
        log(
            INFO,
            "fedddl: %s: %d messages, %d bytes down (%.1fx fewer than whole models); "
            "%d replies, %d bytes up%s",
            kind, self.messages_down, self.bytes_down,
            self.plain * self.messages_down / max(self.bytes_down, 1),
            len(replies), self.bytes_up,
            f" ({self.plain * len(replies) / max(self.bytes_up, 1):.1f}x fewer than whole models)"
            if trains else "",
        )  # fmt: skip
        return replies

    def summary(self) -> str:
        """The run's totals and the ratios to whole models."""
        t = self.totals
        return (
            f"in all: {t['down']} bytes down in {t['messages']} messages "
            f"({self.plain * t['messages'] / max(t['down'], 1):.1f}x fewer than whole models), "
            f"{t['up']} bytes up in {t['replies']} train replies "
            f"({self.plain * t['replies'] / max(t['up'], 1):.1f}x fewer); "
            f"a whole model is {self.plain} bytes"
        )
