"""TernGrad's run options: fp32 exemptions, warm-up, local steps, evaluation, your model and data.

Through the real ServerApp loop and ClientApp on the in-process grid (no Ray), or
through the Flower-free server and worker where the option lives there.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Message

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.compression import decode_update
from fedddl.compression.codecs.downlink import decode_broadcast_parts
from fedddl.data import as_tensors, load_dataset
from fedddl.flower.inline_grid import InlineGrid
from fedddl.models import create_model
from fedddl.partition import stratified_shards
from fedddl.replica import Replica
from fedddl.seeding import derive_seed
from fedddl.sync import ReplicaServer
from fedddl.sync.exemptions import exempt_parameters, logits_parameters
from fedddl.sync.worker import WorkerState, run_instruction
from fedddl.training import compute_gradients, iterate_minibatches, named_gradients
from strategies.server_app import run_server


def _serve(cfg: AppConfig, nodes: int = 4) -> tuple[dict[str, Any], list[Message], list[Message]]:
    sent: list[Message] = []
    replies: list[Message] = []

    def tamper(message: Message, reply: Message) -> Message:
        sent.append(message)
        replies.append(reply)
        return reply

    grid = InlineGrid(make_client_app(cfg), nodes, tamper=tamper)
    result = run_server(grid, cfg.replace(min_available_nodes=nodes), progress=lambda _: None)
    return result, sent, replies


def _payload(reply: Message) -> bytes:
    return bytes(reply.content["update"]["payload"].data)  # type: ignore[index,union-attr]


def test_exempt_parameters_are_the_logits_and_the_small_ones() -> None:
    mlp = create_model("digits", seed=0)
    assert logits_parameters(mlp) == ["3.weight", "3.bias"]
    resnet = create_model("cifar10", seed=0, arch="resnet8")
    assert logits_parameters(resnet) == ["fc.weight", "fc.bias"]
    small = exempt_parameters(resnet, min_numel=100, logits=False)
    assert small and all(dict(resnet.named_parameters())[n].numel() < 100 for n in small)
    assert exempt_parameters(mlp, min_numel=0, logits=False) == frozenset()
    with pytest.raises(ValueError, match="fp32-min-numel"):
        exempt_parameters(mlp, min_numel=-1, logits=True)


def _ternary_per_channel(tensor: torch.Tensor) -> bool:
    """Every output channel (a 1-D tensor: the whole tensor) holds 0 and one magnitude."""
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(1, -1)
    return all(torch.unique(row.abs()).numel() <= 2 for row in rows)


def test_logits_travel_in_fp32_both_ways_and_the_rest_stays_ternary() -> None:
    cfg = AppConfig(num_server_rounds=3, fp32_logits=True)
    result, sent, replies = _serve(cfg)
    assert all(r["replicas_equal"] for r in result["rounds"])
    grad = decode_update(_payload(replies[-1]))
    for name, tensor in grad.items():
        distinct = torch.unique(tensor.abs()).numel()
        if name.startswith("3."):
            assert distinct > 3, name  # exact fp32 values
        else:
            assert _ternary_per_channel(tensor), name  # 0 and one scale per output channel
    update = sent[-1].content["updates"]  # the broadcast of round 2, sent in round 3
    (payload,) = [bytes(a.data) for a in update.values()]  # type: ignore[union-attr]
    down, _ = decode_broadcast_parts(payload)
    assert torch.unique(down["3.weight"].abs()).numel() > 3
    assert _ternary_per_channel(down["1.weight"])
    plain, _, _ = _serve(cfg.replace(fp32_logits=False))
    assert result["summary"]["mean_bytes_up"] > plain["summary"]["mean_bytes_up"]


def test_warm_up_rounds_send_fp32_then_switch_to_ternary() -> None:
    cfg = AppConfig(num_server_rounds=4, fp32_warmup_rounds=2, fp32_logits=False)
    result, sent, _ = _serve(cfg)
    per_round = [r["bytes_up"] for r in result["rounds"]]
    assert per_round[0] > 10 * per_round[2] and per_round[1] > 10 * per_round[3]
    told = [m.content["config"].get("compressor") for m in sent]  # type: ignore[union-attr]
    assert told[:4] == ["identity"] * 4  # round 1, every node
    assert told[8:12] == ["ternary-base3"] * 4  # round 3: the name changed, everyone is told
    assert all(r["replicas_equal"] for r in result["rounds"])


def test_shared_scale_sum_with_exempt_logits_is_a_bundle() -> None:
    cfg = AppConfig(num_server_rounds=3, downlink="shared-scale-sum", fp32_logits=True)
    result, sent, _ = _serve(cfg)
    formats = [r["downlink_format"] for r in result["rounds"]]
    assert formats == ["encoded", "shared-scale-sum", "shared-scale-sum"]
    payload = bytes(next(iter(sent[-1].content["updates"].values())).data)  # type: ignore[union-attr]
    assert payload[:1] == b"B"
    down, _ = decode_broadcast_parts(payload)
    assert set(down) == {"1.weight", "1.bias", "3.weight", "3.bias"}


def test_local_steps_follow_the_documented_algorithm_against_a_reference() -> None:
    """K = 3 local steps, fp32 both ways (GradientAverage), 2 clients, 2 rounds: the server's
    replica equals a hand-written local gradient averaging with server momentum SGD."""
    cfg = AppConfig(strategy="gradient-average", local_steps=3, learning_rate=0.1, momentum=0.9)
    x, y = as_tensors(load_dataset("digits", split="train"))
    shards = stratified_shards(y.numpy(), 2, seed=0)
    server = ReplicaServer(cfg.model_factory(), compressor="identity", learning_rate=0.1)
    states = [WorkerState(), WorkerState()]
    reference = Replica(cfg.model_factory()(), 0.1, 0.9)
    for r in (1, 2):
        plan = server.plan_round(r, [0, 1])
        replies = [
            run_instruction(states[i], plan[i], node_id=i, partition_id=i,
                            shard=lambda i=i: (x[shards[i]], y[shards[i]]),  # type: ignore[misc]
                            model_fn=cfg.model_factory(), cfg=cfg)
            for i in (0, 1)
        ]
        server.aggregate(r, replies)
        means = []
        for i in (0, 1):  # the algorithm, written out: K plain SGD steps, mean gradient
            work = copy.deepcopy(reference.model)
            gen = torch.Generator().manual_seed(derive_seed(cfg.seed, i, r, 3))
            batches = iterate_minibatches(x[shards[i]], y[shards[i]], 32, gen)
            total = {k: torch.zeros_like(p) for k, p in work.named_parameters()}
            for _ in range(3):
                compute_gradients(work, *next(batches))
                for k, g in named_gradients(work).items():
                    total[k] += g
                with torch.no_grad():
                    for p in work.parameters():
                        p -= 0.1 * p.grad  # type: ignore[operator]
            means.append({k: v / 3 for k, v in total.items()})
        average = {k: (means[0][k] + means[1][k]) / 2 for k in means[0]}
        reference.apply_update(average, r)
    for name, param in server.shadow.model.named_parameters():
        torch.testing.assert_close(param, dict(reference.model.named_parameters())[name])


def test_eval_every_and_eval_samples() -> None:
    cfg = AppConfig(num_server_rounds=5, eval_every=2, eval_samples=100)
    result, _, _ = _serve(cfg, nodes=2)
    scored = [r["accuracy"] is not None for r in result["rounds"]]
    assert scored == [False, True, False, True, True]  # every 2nd round and the last
    accuracies = [r["accuracy"] for r in result["rounds"] if r["accuracy"] is not None]
    assert all(round(a * 100) == a * 100 for a in accuracies)  # out of 100 examples
    assert result["summary"]["final_accuracy"] == accuracies[-1]


def test_your_own_model_and_data_through_the_run_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented example, docs/examples/my_task.py, as the README shows it."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "docs" / "examples"))
    cfg = AppConfig(num_server_rounds=2, dataset="my_task:blobs", model="my_task:small_bn_cnn")
    result, _, replies = _serve(cfg, nodes=3)
    assert all(r["replicas_equal"] for r in result["rounds"])
    grad = decode_update(_payload(replies[-1]))
    assert set(grad) >= {"0.weight", "1.weight", "8.weight"}  # the user's layers
    with pytest.raises(ValueError, match="must look like"):
        AppConfig(model="no_colon")
    with pytest.raises(ValueError, match="not both"):
        AppConfig(model="a:b", arch="cnn")
    with pytest.raises(TypeError, match="returned list"):
        create_model("digits", seed=0, arch="tests.support.models:not_a_model")
    with pytest.raises(ValueError, match="cannot import"):
        create_model("digits", seed=0, arch="no_such_module_xyz:f")
