"""ClientApp of the latency probe: one SGD step per train message."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from latency_app.model import make_data, make_model

app = ClientApp()


def _data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    partition = int(context.node_config.get("partition-id", context.node_id % 1000))
    return make_data(seed=100 + partition)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Load the global model, take one SGD step on the local shard, reply."""
    model = make_model()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    x, y = _data(context)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]  # torch stubs leave it untyped
    optimizer.step()
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": float(loss), "num-examples": len(y)}),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global model on the local shard."""
    model = make_model()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    x, y = _data(context)
    with torch.no_grad():
        logits = model(x)
    metrics = MetricRecord(
        {
            "eval_loss": float(torch.nn.functional.cross_entropy(logits, y)),
            "eval_acc": float((logits.argmax(1) == y).float().mean()),
            "num-examples": len(y),
        }
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
