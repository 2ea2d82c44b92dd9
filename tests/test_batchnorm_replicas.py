"""BatchNorm statistics: recorded by clients, pooled by the server, applied by every replica.

Unit tests against references (BatchNorm's own running update, statistics of the
concatenated batches), then a BatchNorm CNN trained with TernGrad end to end without
Flower: its eval-mode accuracy matches its train-mode accuracy, its running statistics
moved, and every replica's buffers are bit-identical to the server's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedddl.app_config import AppConfig
from fedddl.data import as_tensors, load_dataset
from fedddl.models import create_model
from fedddl.partition import stratified_shards
from fedddl.replica import Replica, ReplicaError
from fedddl.running_stats import (
    StatisticsError,
    StatisticsPool,
    apply_statistics,
    check_statistics,
    record_batch_statistics,
)
from fedddl.sync import ReplicaServer
from fedddl.sync.worker import WorkerState, compute_pseudo_gradient, run_instruction
from fedddl.training import evaluate


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(48, 2))


def test_recorded_statistics_are_those_of_all_batches_together() -> None:
    net = _net()
    batches = [torch.randn(5, 1, 6, 6) * (i + 1) + i for i in range(3)]
    with record_batch_statistics(net) as recorder:
        for x in batches:
            net(x)
    stats = recorder.result()
    inputs = net[0](torch.cat(batches)).detach().double()  # what the BatchNorm layer saw
    torch.testing.assert_close(
        stats["1.mean"].double(), inputs.mean(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        stats["1.var"].double(), inputs.var(dim=(0, 2, 3), unbiased=False), rtol=1e-5, atol=1e-6
    )
    assert float(stats["1.count"]) == 15 * 4 * 4
    net.eval()
    with record_batch_statistics(net) as recorder:
        net(batches[0])
    assert recorder.result() == {}  # eval-mode forwards are not training data


def test_applying_one_batch_of_statistics_equals_batchnorm_own_update() -> None:
    net, ref = _net(), _net()
    x = torch.randn(8, 1, 6, 6)
    with record_batch_statistics(net) as recorder:
        net(x)
    stats = recorder.result()
    fresh = _net()  # the recording forward moved net's own buffers; start from the same
    apply_statistics(fresh, stats)
    ref(x)  # BatchNorm's own training-mode update
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(fresh[1], name), getattr(ref[1], name))
    assert int(fresh[1].num_batches_tracked) == 1


def test_pool_is_the_equal_weight_union_of_the_clients() -> None:
    gen = torch.Generator().manual_seed(1)
    clients = [torch.randn(400, generator=gen) * (k + 1) + 3 * k for k in range(3)]
    pool = StatisticsPool()
    for data in clients:
        pool.add(
            {
                "bn.mean": data.mean().reshape(1),
                "bn.var": data.var(unbiased=False).reshape(1),
                "bn.count": torch.tensor([400.0]),
            }
        )
    pooled = pool.result()
    union = torch.cat(clients).double()
    torch.testing.assert_close(
        pooled["bn.mean"].double(), union.mean().reshape(1), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        pooled["bn.var"].double(), union.var(unbiased=False).reshape(1), rtol=1e-5, atol=1e-5
    )
    assert float(pooled["bn.count"]) == 1200


def test_bad_statistics_are_named_and_change_nothing() -> None:
    net = _net()
    good = {"1.mean": torch.zeros(3), "1.var": torch.ones(3), "1.count": torch.tensor([10.0])}
    check_statistics(net, good)
    for bad, reason in [
        ({**good, "1.var": -torch.ones(3)}, "var must be >= 0"),
        ({**good, "1.mean": torch.full((3,), float("nan"))}, "finite"),
        ({**good, "1.mean": torch.zeros(4)}, "3 channels"),
        ({k: v for k, v in good.items() if k != "1.count"}, "missing"),
        ({**good, "9.mean": torch.zeros(3)}, "unexpected"),
    ]:
        before = copy.deepcopy(net.state_dict())
        with pytest.raises(StatisticsError, match=reason):
            apply_statistics(net, bad)
        assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    replica = Replica(_net(), 0.1, 0.9)
    update = {k: torch.zeros_like(p) for k, p in replica.model.named_parameters()}
    with pytest.raises(ReplicaError, match="statistics"):
        replica.apply_update(update, 1)  # a BatchNorm model needs statistics with its update
    assert replica.version == 0


def test_a_client_gradient_leaves_its_replica_buffers_alone() -> None:
    model = create_model("digits", seed=0, arch="resnet8")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.rand(40, 1, 8, 8), torch.randint(0, 10, (40,))
    _, _, _, stats = compute_pseudo_gradient(
        model, x, y, batch_size=16, local_steps=2, learning_rate=0.1, seed=0
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {k.rsplit(".", 1)[1] for k in stats} == {"mean", "var", "count"}
    check_statistics(model, stats)
    assert float(stats["bn.count"]) == 2 * 16 * 8 * 8  # two minibatches of 16 8x8 images


def test_terngrad_trains_a_batchnorm_cnn_whose_eval_mode_is_right() -> None:
    """ResNet-8 on digits, 4 clients, TernGrad: eval-mode accuracy within 2 points of the
    same model's train-mode accuracy on the same data, running statistics moved, every
    replica (buffers included) bit-identical to the server's."""
    cfg = AppConfig(arch="resnet8", learning_rate=0.05)
    x, y = as_tensors(load_dataset("digits", split="train"))
    shards = stratified_shards(y.numpy(), 4, seed=0)
    server = ReplicaServer(
        cfg.model_factory(), learning_rate=0.05, momentum=0.9, compressor=cfg.compressor,
        fp32_logits=cfg.fp32_logits,
    )
    states = [WorkerState() for _ in shards]
    rounds = 40
    for r in range(1, rounds + 2):
        plan = server.plan_round(r, range(len(shards)))
        replies = [
            run_instruction(states[i], plan[i], node_id=i, partition_id=i,
                            shard=lambda i=i: (x[shards[i]], y[shards[i]]),  # type: ignore[misc]
                            model_fn=cfg.model_factory(), cfg=cfg)
            for i in range(len(shards))
        ]
        if r <= rounds:
            server.aggregate(r, replies)
    assert all(rep.replicas_equal for rep in server.reports)
    shadow = server.shadow.model
    for state in states:  # the extra instruction brought every worker to the last version
        assert state.replica is not None
        assert state.replica.fingerprint() == server.shadow.fingerprint()
    x_test, y_test = as_tensors(load_dataset("digits", split="test"))
    _, eval_acc = evaluate(shadow, x_test, y_test)
    train_mode = copy.deepcopy(shadow).train()
    with torch.no_grad():
        train_acc = float((train_mode(x_test).argmax(1) == y_test).float().mean())
    assert eval_acc > 0.7, eval_acc
    assert abs(eval_acc - train_acc) <= 0.02, (eval_acc, train_acc)
    bn = shadow.get_submodule("bn")
    assert int(bn.num_batches_tracked) == rounds
    assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))


def _trained(cfg: AppConfig, rounds: int) -> tuple[ReplicaServer, list[WorkerState]]:
    """``rounds`` TernGrad rounds of ResNet-8 on 2 digits clients, then one more plan that
    brings both workers to the last version."""
    x, y = as_tensors(load_dataset("digits", split="train"))
    shards = stratified_shards(y.numpy(), 2, seed=0)
    server = ReplicaServer(
        cfg.model_factory(), learning_rate=cfg.learning_rate, momentum=cfg.momentum,
        compressor=cfg.compressor, fp32_logits=cfg.fp32_logits,
    )
    states = [WorkerState() for _ in shards]
    for r in range(1, rounds + 2):
        plan = server.plan_round(r, range(len(shards)))
        replies = [
            run_instruction(states[i], plan[i], node_id=i, partition_id=i,
                            shard=lambda i=i: (x[shards[i]], y[shards[i]]),  # type: ignore[misc]
                            model_fn=cfg.model_factory(), cfg=cfg)
            for i in range(len(shards))
        ]
        if r <= rounds:
            server.aggregate(r, replies)
    return server, states


def test_bn_momentum_moves_the_running_statistics_and_never_the_weights() -> None:
    default, _ = _trained(AppConfig(arch="resnet8"), 4)
    faster, states = _trained(AppConfig(arch="resnet8", bn_momentum=0.5), 4)
    assert all(len(rep.accepted) == 2 for rep in default.reports + faster.reports)
    initial = AppConfig(arch="resnet8").model_factory()()
    assert not torch.equal(initial.conv.weight, faster.shadow.model.conv.weight)
    layers = [m for m in faster.shadow.model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert layers and all(m.momentum == 0.5 for m in layers)
    assert all(
        m.momentum == 0.1 for m in default.shadow.model.modules() if isinstance(m, nn.BatchNorm2d)
    )
    for (name, p), q in zip(
        default.shadow.model.named_parameters(), faster.shadow.model.parameters(), strict=True
    ):
        assert torch.equal(p, q), name
    ran, fast = default.shadow.model.get_submodule("bn"), faster.shadow.model.get_submodule("bn")
    assert int(ran.num_batches_tracked) == int(fast.num_batches_tracked) == 4
    assert not torch.allclose(ran.running_var, fast.running_var)
    assert all(rep.replicas_equal for rep in faster.reports)
    for state in states:
        assert state.replica is not None
        assert state.replica.fingerprint() == faster.shadow.fingerprint()


@pytest.mark.parametrize("momentum", [-0.1, 1.5])
def test_bn_momentum_outside_its_range_is_refused(momentum: float) -> None:
    with pytest.raises(ValueError, match="bn-momentum"):
        AppConfig(bn_momentum=momentum)
