"""Tests of fedddl.models.create_model: shapes, architectures and seeded determinism."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedddl.data import dataset_info
from fedddl.models import DigitsMLP, SmallCNN, create_model

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def state_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    ("dataset", "arch", "cls"),
    [("digits", None, DigitsMLP), ("fashion-mnist", None, SmallCNN), ("digits", "cnn", SmallCNN)],
)
def test_small_models_shapes_and_defaults(dataset: str, arch: str | None, cls: type) -> None:
    model = create_model(dataset, seed=0, arch=arch)
    assert isinstance(model, cls)
    info = dataset_info(dataset)
    out = model(torch.rand(3, *info.input_shape))
    assert out.shape == (3, info.num_classes)


@pytest.mark.parametrize("dataset", ["digits", "mnist"])
def test_same_seed_same_weights_different_seed_different(dataset: str) -> None:
    assert state_equal(create_model(dataset, seed=5), create_model(dataset, seed=5))
    assert not state_equal(create_model(dataset, seed=5), create_model(dataset, seed=6))


def test_global_rng_is_neither_used_nor_disturbed() -> None:
    torch.manual_seed(1)
    state = torch.get_rng_state()
    first = create_model("digits", seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(2)
    assert state_equal(first, create_model("digits", seed=3))


def test_resnet18_is_cifar_style_and_seeded() -> None:
    model = create_model("cifar10", seed=0)
    conv1 = model.conv1
    assert isinstance(conv1, nn.Conv2d)
    assert conv1.kernel_size == (3, 3) and conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    assert any("running_mean" in name for name, _ in model.named_buffers())
    model.eval()
    with torch.no_grad():
        assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)
    assert state_equal(model, create_model("cifar10", seed=0))


def test_resnet18_takes_tiny_imagenet_and_grey_input() -> None:
    model = create_model("tiny-imagenet", seed=0).eval()
    with torch.no_grad():
        assert model(torch.rand(1, 3, 64, 64)).shape == (1, 200)
    grey = create_model("mnist", seed=0, arch="resnet18").eval()
    with torch.no_grad():
        assert grey(torch.rand(1, 1, 28, 28)).shape == (1, 10)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown arch 'vgg'"):
        create_model("digits", seed=0, arch="vgg")
    with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
        create_model("svhn", seed=0)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        create_model("digits", seed=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        create_model("digits", seed=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("arch", "limit"), [("resnet8", 100_000), ("resnet20", 300_000)])
def test_cifar_resnets_are_small_batchnorm_cnns_for_both_input_kinds(arch: str, limit: int) -> None:
    from torch import nn

    for dataset, shape in (("fashion-mnist", (1, 28, 28)), ("cifar10", (3, 32, 32))):
        model = create_model(dataset, seed=0, arch=arch)
        again = create_model(dataset, seed=0, arch=arch)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                      again.state_dict().values(), strict=True))
        assert sum(p.numel() for p in model.parameters()) < limit
        assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
        assert model(torch.rand(2, *shape)).shape == (2, 10)
