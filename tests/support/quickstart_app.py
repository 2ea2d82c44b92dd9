"""A Flower app written like Flower's own PyTorch quickstart, on scikit-learn digits.

``task`` part (model, data, train, test), a ``ClientApp`` with ``@app.train()`` /
``@app.evaluate()`` returning ``ArrayRecord`` + ``MetricRecord``, and a ``ServerApp``
running ``FedAvg`` with a central evaluation -- nothing of fedddl in the training code.
:func:`make_apps` optionally adds fedddl's ternary compression the way a user would: the
``ternary_mod`` in ``mods`` and the strategy wrapped in ``TernaryDelta``. The server
counts the serialized bytes of every message (per exchange) through
:class:`~fedddl.flower.grid.CountingGrid`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy
from sklearn.datasets import load_digits
from torch import nn

from fedddl.flower.grid import CountingGrid


# ----------------------------------------------------------------------------- task.py
class Net(nn.Module):
    """A small CNN for 8x8 digits (the quickstart's ``Net`` for CIFAR-10, scaled down)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    return x, torch.tensor(data.target, dtype=torch.int64)


def load_data(partition_id: int, num_partitions: int) -> tuple[Any, Any]:
    """IID partition ``partition_id`` of the first 1400 digits; the last 397 are the test set."""
    x, y = _digits()
    order = np.random.default_rng(0).permutation(1400)
    part = np.array_split(order, num_partitions)[partition_id]
    return (x[part], y[part]), (x[1400:], y[1400:])


def train(net: nn.Module, data: Any, epochs: int, lr: float, seed: int) -> float:
    """Plain minibatch SGD; returns the mean training loss."""
    x, y = data
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    net.train()
    losses = []
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(16):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(float(loss.detach()))
    return float(np.mean(losses))


def test(net: nn.Module, data: Any) -> tuple[float, float]:
    """(loss, accuracy) on ``data``."""
    x, y = data
    net.eval()
    with torch.no_grad():
        logits = net(x)
    loss = float(nn.functional.cross_entropy(logits, y))
    return loss, float((logits.argmax(1) == y).float().mean())


# ----------------------------------------------------------------------- the two apps
def _reply_order(reply: Message) -> tuple[bool, str]:
    """A fixed order of replies: errors last, then by a digest of the serialized content."""
    if reply.has_error():
        return True, reply.error.reason
    data = recorddict_to_proto(reply.content).SerializeToString(deterministic=True)
    return False, hashlib.sha256(data).hexdigest()


class ExchangeCountingGrid(CountingGrid):
    """A :class:`CountingGrid` that also records the bytes of each exchange.

    It hands replies on in a fixed order (by content), not in arrival order: FedAvg sums
    them in the order given, and float sums in another order differ in the last bits,
    which training amplifies; with a fixed order a run replays exactly.
    """

    def __init__(self, inner: Grid) -> None:
        super().__init__(inner)
        self.exchanges: list[dict[str, Any]] = []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        self.reset()
        replies = sorted(super().send_and_receive(messages, timeout=timeout), key=_reply_order)
        kind = messages[0].metadata.message_type if messages else ""
        self.exchanges.append(
            {"type": kind, "down": self.bytes_down, "up": self.bytes_up,
             "replies": sum(not r.has_error() for r in replies)}
        )  # fmt: skip
        return replies


def make_client_app(*, compressed: bool, local_epochs: int = 1) -> ClientApp:
    """The quickstart's ClientApp; ``compressed`` adds ``mods=[ternary_mod]``."""
    mods = []
    if compressed:
        from fedddl.flower import ternary_mod

        mods = [ternary_mod]
    app = ClientApp(mods=mods)

    @app.train()
    def train_fn(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        partition_id = int(context.node_config["partition-id"])
        trainloader, _ = load_data(partition_id, int(context.node_config["num-partitions"]))
        config = msg.content["config"]
        seed = 1000 * int(config["server-round"]) + partition_id  # type: ignore[index, arg-type]
        loss = train(model, trainloader, local_epochs, float(config["lr"]), seed)  # type: ignore[index, arg-type]
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"train_loss": loss, "num-examples": len(trainloader[1])}),
            }
        )
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate_fn(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        partition_id = int(context.node_config["partition-id"])
        _, testloader = load_data(partition_id, int(context.node_config["num-partitions"]))
        loss, acc = test(model, testloader)
        metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": 1})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def run_server(
    grid: Grid,
    *,
    compressed: bool,
    num_rounds: int,
    lr: float = 0.1,
    wrap: Callable[[Strategy], Strategy] | None = None,
) -> dict[str, Any]:
    """The quickstart's ServerApp main: FedAvg (wrapped in ``TernaryDelta`` when
    ``compressed``; ``wrap`` replaces that wrapper) with a central evaluation.

    Returns ``{"accuracy": [...], "loss": [...] (round 0..num_rounds), "exchanges": [...],
    "strategy": strategy}``.
    """
    torch.manual_seed(0)
    counting = ExchangeCountingGrid(grid)
    strategy: Strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.5)
    if compressed:
        from fedddl.flower import TernaryDelta

        strategy = wrap(strategy) if wrap is not None else TernaryDelta(strategy)
    history: dict[str, list[float]] = {"accuracy": [], "loss": []}
    _, test_data = load_data(0, 1)

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = test(model, test_data)
        history["accuracy"].append(acc)
        history["loss"].append(loss)
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy.start(
        grid=counting,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=num_rounds,
        train_config=ConfigRecord({"lr": lr}),
        evaluate_fn=global_evaluate,
    )
    return {**history, "exchanges": counting.exchanges, "strategy": strategy}


def make_server_app(
    *, compressed: bool, num_rounds: int, sink: Callable[[dict[str, Any]], None]
) -> ServerApp:
    """The quickstart's ServerApp; ``sink`` receives :func:`run_server`'s result."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        sink(run_server(grid, compressed=compressed, num_rounds=num_rounds))

    return app
