"""Building the simulated nodes: data shards, models, step times, message size."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch

from fedddl.compression import IdentityCompressor, encode_update
from fedddl.data import as_tensors, load_dataset
from fedddl.gossip.eval_subset import eval_subset
from fedddl.gossip.sim_config import GossipConfig
from fedddl.gossip.sim_node import SimNode
from fedddl.models import create_model
from fedddl.partition import make_shards

__all__ = ["SimSetup", "build_setup", "model_message_bytes"]

_MEASURE_STEPS = 10


@dataclass
class SimSetup:
    """Nodes and test data of one run."""

    nodes: list[SimNode]
    x_test: torch.Tensor
    y_test: torch.Tensor
    model_bytes: int
    initial_state: dict[str, torch.Tensor]


def model_message_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of one model message: the floating tensors as uncompressed ``encode_update`` wire
    bytes, the others (BatchNorm's ``num_batches_tracked``) at their raw size, as the peers'
    MODEL frames carry them."""
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    others = sum(v.numel() * v.element_size() for v in state.values() if not v.is_floating_point())
    return len(encode_update(floats, IdentityCompressor())) + others


def build_setup(config: GossipConfig) -> SimSetup:
    """Load data, shard it, and create one identically initialised model per node."""
    x, y = as_tensors(load_dataset(config.dataset, config.data_root, split="train"))
    x_test, y_test = as_tensors(load_dataset(config.dataset, config.data_root, split="test"))
    # A fixed random test subset keeps evaluation cheap and the same for every run.
    x_test, y_test = eval_subset(x_test, y_test, config.eval_samples, config.seed)
    shards = make_shards(config.partition, y.numpy(), config.nodes, seed=config.seed)
    base = create_model(config.dataset, seed=config.seed, arch=config.arch)
    model_bytes = model_message_bytes(base.state_dict())
    factors = 1.0 + config.compute_heterogeneity * np.random.default_rng(
        [config.seed, 7]
    ).uniform(size=config.nodes)
    nodes = []
    for i, shard in enumerate(shards):
        index = torch.from_numpy(shard)
        nodes.append(
            SimNode(
                i,
                copy.deepcopy(base),
                x[index],
                y[index],
                batch_size=config.batch_size,
                lr=config.lr,
                step_time_s=1.0,  # set below
                seed=config.seed * 1000 + i,
            )
        )
    base_step = config.compute_time_s
    if base_step is None:
        base_step = _measure_step_time(nodes[0], base)
    for node, factor in zip(nodes, factors, strict=True):
        node.step_time_s = float(base_step * factor)
    initial = {k: v.detach().clone() for k, v in base.state_dict().items()}
    return SimSetup(nodes, x_test, y_test, model_bytes, initial)


def _measure_step_time(node: SimNode, initial: torch.nn.Module) -> float:
    """Mean wall time of a real SGD step of ``node``, whose model is reset afterwards."""
    node.sgd_step()  # warm-up
    start = time.perf_counter()
    for _ in range(_MEASURE_STEPS):
        node.sgd_step()
    elapsed = (time.perf_counter() - start) / _MEASURE_STEPS
    node.model.load_state_dict(initial.state_dict())
    node.steps = node.version = 0
    return elapsed
