"""quickstart_compressed: the quickstart's ClientApp, plus fedddl's ``ternary_mod``."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedddl.flower import ternary_mod  # fedddl: the client mod
from quickstart_compressed.task import Net, load_data
from quickstart_compressed.task import test as test_fn
from quickstart_compressed.task import train as train_fn

# Flower ClientApp; fedddl: the only change is mods=[ternary_mod]
app = ClientApp(mods=[ternary_mod])


def _loaders(context: Context):  # type: ignore[no-untyped-def]
    return load_data(
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        int(context.run_config["batch-size"]),
        int(context.run_config["samples-per-client"]),
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model on local data."""
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    trainloader, _ = _loaders(context)
    train_loss = train_fn(
        model,
        trainloader,
        int(context.run_config["local-epochs"]),
        float(msg.content["config"]["lr"]),  # type: ignore[index, arg-type]
        device,
    )
    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}  # type: ignore[arg-type]
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the model on local data."""
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    _, valloader = _loaders(context)
    eval_loss, eval_acc = test_fn(model, valloader, device)
    metrics = {
        "eval_loss": eval_loss,
        "eval_acc": eval_acc,
        "num-examples": len(valloader.dataset),  # type: ignore[arg-type]
    }
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
