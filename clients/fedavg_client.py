"""Client side of stock Flower FedAvg: receive weights, train K local steps, return weights."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from clients.shard import load_shard, partition_of
from fedddl.app_config import AppConfig
from fedddl.devices import resolve_device
from fedddl.flower.protocol import FEDAVG_ARRAYS
from fedddl.flower.records import record_of
from fedddl.seeding import derive_seed

__all__ = ["handle_fedavg_evaluate", "handle_fedavg_train"]


def _model_from(message: Message, cfg: AppConfig) -> torch.nn.Module:
    arrays = record_of(message.content, FEDAVG_ARRAYS, ArrayRecord)
    if arrays is None:
        raise ValueError(f"FedAvg message has no {FEDAVG_ARRAYS!r} ArrayRecord")
    model = cfg.model_factory(device=resolve_device(cfg.device))()
    model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    return model


def handle_fedavg_train(message: Message, context: Context, cfg: AppConfig) -> Message:
    """Load the global weights, run ``local-steps`` SGD steps on the shard, reply weights."""
    from fedddl.training import iterate_minibatches, local_sgd

    model = _model_from(message, cfg)
    pid, num = partition_of(context.node_config)
    x, y = load_shard(cfg, pid, num)
    config = record_of(message.content, "config", ConfigRecord)
    server_round = int(config.get("server-round", 0)) if config is not None else 0  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(derive_seed(cfg.seed, pid, server_round, 3))
    batches = iterate_minibatches(x, y, min(cfg.batch_size, x.shape[0]), generator)
    lr = cfg.lr_decay().rate(cfg.learning_rate, server_round)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum)
    loss, examples = local_sgd(model, batches, cfg.local_steps, optimizer)
    content = RecordDict(
        {
            FEDAVG_ARRAYS: ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": examples, "train-loss": loss}),
        }
    )
    return Message(content=content, reply_to=message)


def handle_fedavg_evaluate(message: Message, context: Context, cfg: AppConfig) -> Message:
    """Evaluate the received weights on the client's shard."""
    from fedddl.training import evaluate

    model = _model_from(message, cfg)
    pid, num = partition_of(context.node_config)
    x, y = load_shard(cfg, pid, num)
    loss, acc = evaluate(model, x, y)
    metrics = MetricRecord({"num-examples": int(x.shape[0]), "eval-loss": loss, "eval-acc": acc})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=message)
