"""Tests of fedddl.training against manual reference computations."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional

from fedddl.models import create_model
from fedddl.training import (
    compute_gradients,
    evaluate,
    iterate_minibatches,
    named_gradients,
    parameters_fingerprint,
    set_gradients,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

Batch = tuple[torch.Tensor, torch.Tensor]


def test_compute_gradients_matches_autograd_and_does_not_accumulate(digits_train: Batch) -> None:
    x, y = digits_train[0][:50], digits_train[1][:50]
    model = create_model("digits", seed=0)
    reference = copy.deepcopy(model)
    ref_loss = functional.cross_entropy(reference(x), y)
    ref_grads = torch.autograd.grad(ref_loss, list(reference.parameters()))
    compute_gradients(model, x, y)
    loss = compute_gradients(model, x, y)  # second call must not add to the first
    assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    for (name, grad), ref in zip(named_gradients(model).items(), ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, msg=name)


def test_named_gradients_are_copies_and_zero_when_missing() -> None:
    model = create_model("digits", seed=0)
    grads = named_gradients(model)
    assert set(grads) == {n for n, _ in model.named_parameters()}
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())
    compute_gradients(model, torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]))
    copied = named_gradients(model)
    copied["1.weight"].add_(1.0)
    grad = model.get_parameter("1.weight").grad
    assert grad is not None and not torch.equal(copied["1.weight"], grad)


def test_set_gradients_round_trip_and_validation() -> None:
    model = create_model("digits", seed=0)
    grads = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    set_gradients(model, grads)
    grads["1.bias"].add_(1.0)  # set_gradients stored a copy, so this must not leak
    assert torch.equal(named_gradients(model)["1.bias"], torch.full((64,), 0.5))
    before = named_gradients(model)
    bad_shape = dict(named_gradients(model), **{"1.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"'1\.weight' has shape"):
        set_gradients(model, bad_shape)
    with pytest.raises(ValueError, match=r"missing \['3\.bias'\]"):
        set_gradients(model, {k: v for k, v in before.items() if k != "3.bias"})
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        set_gradients(model, dict(before, extra=torch.zeros(1)))
    with pytest.raises(ValueError, match="floating-point"):
        set_gradients(model, {k: v.long() for k, v in before.items()})
    for name, grad in named_gradients(model).items():  # failed calls changed nothing
        torch.testing.assert_close(grad, before[name], rtol=0, atol=0)


def test_evaluate_matches_manual_reference(digits_test: Batch) -> None:
    x, y = digits_test
    model = create_model("digits", seed=1)
    with torch.no_grad():
        logits = model(x)
    ref_loss = float(functional.cross_entropy(logits, y))
    ref_acc = int((logits.argmax(1) == y).sum()) / y.shape[0]
    loss, acc = evaluate(model, x, y, batch_size=7)  # 450 rows: many batches + a remainder
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert acc == pytest.approx(ref_acc, abs=1e-12)
    assert model.training  # mode restored
    assert all(p.grad is None for p in model.parameters())


def test_evaluate_uses_eval_mode_for_batchnorm() -> None:
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))
    before = parameters_fingerprint(model)
    evaluate(model, x, y)
    assert parameters_fingerprint(model) == before  # running stats untouched
    with pytest.raises(ValueError, match="y must be 1-D with 10 labels"):
        evaluate(model, x, y[:5])


def test_fingerprint_is_exact() -> None:
    a, b = create_model("mnist", seed=0), create_model("mnist", seed=0)
    fp = parameters_fingerprint(a)
    assert len(fp) == 64 and fp == parameters_fingerprint(b)
    weight = b.get_parameter("0.weight")
    with torch.no_grad():  # move one value by one ulp
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(float("inf")))
    assert parameters_fingerprint(b) != fp
    assert parameters_fingerprint(create_model("mnist", seed=1)) != fp


def test_fingerprint_covers_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    fp = parameters_fingerprint(model)
    model.get_buffer("1.running_mean").add_(1e-3)
    assert parameters_fingerprint(model) != fp


def test_minibatch_stream_is_reproducible_and_covers_each_epoch() -> None:
    x = torch.arange(20, dtype=torch.float32).reshape(20, 1)
    y = torch.arange(20)
    stream = iterate_minibatches(x, y, 5, torch.Generator().manual_seed(3))
    batches = list(itertools.islice(stream, 12))
    for xb, yb in batches:
        assert xb.shape == (5, 1) and torch.equal(xb[:, 0].long(), yb)
    for epoch in range(3):  # 4 batches per epoch, each epoch a permutation
        seen = torch.cat([yb for _, yb in batches[4 * epoch : 4 * epoch + 4]])
        assert torch.equal(seen.sort().values, y)
    assert not torch.equal(batches[0][1], batches[4][1])
    again = iterate_minibatches(x, y, 5, torch.Generator().manual_seed(3))
    for (_, a), (_, b) in zip(batches, itertools.islice(again, 12), strict=True):
        assert torch.equal(a, b)


def test_minibatch_stream_handles_batches_larger_than_data_and_rejects_bad_input() -> None:
    x, y = torch.zeros(3, 2), torch.tensor([0, 1, 2])
    xb, yb = next(iterate_minibatches(x, y, 7, torch.Generator().manual_seed(0)))
    assert xb.shape == (7, 2) and torch.bincount(yb).min() >= 2
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(iterate_minibatches(x, y, 0, torch.Generator()))
    with pytest.raises(ValueError, match="empty batch"):
        next(iterate_minibatches(x[:0], y[:0], 1, torch.Generator()))


def test_mlp_learns_digits(digits_train: Batch, digits_test: Batch) -> None:
    model = create_model("digits", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stream = iterate_minibatches(*digits_train, 32, torch.Generator().manual_seed(0))
    for xb, yb in itertools.islice(stream, 300):
        compute_gradients(model, xb, yb)
        optimizer.step()
    loss, accuracy = evaluate(model, *digits_test)
    assert accuracy > 0.9 and loss < 0.5
