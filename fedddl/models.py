"""Seeded models: an MLP for digits, a small CNN for (Fashion-)MNIST, a CIFAR ResNet-18.

All models take ``N×C×H×W`` float input and return ``N×num_classes`` logits. Weights
depend only on the seed: creation runs under a forked RNG, so the global torch RNG
state is left untouched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import lru_cache

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedddl.data.registry import dataset_info

__all__ = [
    "ARCHITECTURES",
    "CifarResNet",
    "DigitsMLP",
    "SmallCNN",
    "cifar_resnet18",
    "create_model",
    "load_model_factory",
    "seeded_model_factory",
    "with_bn_momentum",
]

ARCHITECTURES: tuple[str, ...] = ("mlp", "cnn", "resnet8", "resnet20", "resnet18")


class DigitsMLP(nn.Sequential):
    """Flatten → Linear(in, hidden) → ReLU → Linear(hidden, classes)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 64):
        super().__init__(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


class SmallCNN(nn.Sequential):
    """Two 3×3 conv blocks (16, 32 channels, each ReLU + 2×2 max-pool) and a 2-layer head."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 128):
        channels, height, width = input_shape
        if height < 4 or width < 4:
            raise ValueError(f"SmallCNN needs images of at least 4×4, got {height}×{width}")
        super().__init__(
            nn.Conv2d(channels, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * (height // 4) * (width // 4), hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


class _BasicBlock(nn.Module):
    """Two 3×3 conv + BatchNorm layers with an identity (or 1×1 projection) shortcut."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """He et al.'s CIFAR ResNet (depth ``6n + 2``: 16/32/64 channels, ``n`` blocks a stage).

    ResNet-8 (``n = 1``, 78 k parameters for 10 classes) and ResNet-20 (``n = 3``, 272 k)
    are small BatchNorm CNNs for 1×28×28 and 3×32×32 inputs (any size: the head pools
    globally).
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, depth: int) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n + 2 >= 8, got {depth}")
        blocks = (depth - 2) // 6
        self.conv = nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        channels = 16
        for stage, width in enumerate((16, 32, 64)):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(_BasicBlock(channels, width, stride))
                channels = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn(self.conv(x)))
        out = self.pool(self.layers(out)).flatten(1)
        logits: torch.Tensor = self.fc(out)
        return logits


def cifar_resnet18(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with a 3×3 stride-1 stem and no max-pool (for 32×32 / 64×64).

    Note that its BatchNorm layers carry buffers (running mean/var, batch counters) that
    belong to the model state alongside the parameters.
    """
    from torchvision.models import resnet18

    model: nn.Module = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()  # type: ignore[assignment]
    return model


def create_model(dataset: str, *, seed: int, arch: str | None = None) -> nn.Module:
    """Create the model for ``dataset`` with weights determined by ``seed`` alone.

    Parameters
    ----------
    dataset : str
        One of :data:`fedddl.data.DATASETS`; fixes input shape and number of classes.
    seed : int
        Non-negative seed; the same seed gives bit-identical weights.
    arch : str, optional
        ``"mlp"``, ``"cnn"``, ``"resnet8"``, ``"resnet20"``, ``"resnet18"``, or your own
        ``"package.module:factory"`` with ``factory(input_shape, num_classes) -> nn.Module``
        (see :func:`load_model_factory`); default is the dataset's ``default_model``.

    Returns
    -------
    torch.nn.Module
        A float32 CPU model in training mode.

    Raises
    ------
    ValueError
        On an unknown dataset or architecture, or a negative seed.
    TypeError
        If ``seed`` is not an int.
    """
    info = dataset_info(dataset)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    name = arch if arch else info.default_model
    user = load_model_factory(name) if ":" in name else None
    if user is None and name not in ARCHITECTURES:
        raise ValueError(
            f"unknown arch {name!r}; expected one of {', '.join(ARCHITECTURES)} "
            "or 'package.module:factory'"
        )
    # fork_rng restores the global CPU RNG afterwards, so callers' streams are unaffected.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if user is not None:
            model = user(info.input_shape, info.num_classes)
            if not isinstance(model, nn.Module):
                raise TypeError(f"model factory {name!r} returned {type(model).__name__}")
            return model
        if name == "mlp":
            return DigitsMLP(info.input_shape, info.num_classes)
        if name == "cnn":
            return SmallCNN(info.input_shape, info.num_classes)
        if name in ("resnet8", "resnet20"):
            return CifarResNet(info.input_shape, info.num_classes, depth=int(name[6:]))
        return cifar_resnet18(info.input_shape, info.num_classes)


def load_model_factory(spec: str) -> Callable[[tuple[int, int, int], int], nn.Module]:
    """Import ``"package.module:factory"``; ``factory(input_shape, num_classes)`` builds a model.

    The factory is called under a seeded RNG (:func:`create_model`), so the same seed
    gives the same weights in the server and every client.

    Raises
    ------
    ValueError
        If the spec is malformed or the module or function cannot be found.
    """
    from fedddl.import_spec import import_attribute

    factory, module_name, attr = import_attribute(spec, "model", "package.module:factory")
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {attr!r} is not a callable in {module_name!r}")
    return factory  # type: ignore[no-any-return]


@lru_cache(maxsize=8)
def _seeded_model(dataset: str, seed: int, arch: str) -> nn.Module:
    return create_model(dataset, seed=seed, arch=arch or None)


def seeded_model_factory(dataset: str, *, seed: int, arch: str = "") -> Callable[[], nn.Module]:
    """Return the seeded model constructor shared by a server and every client.

    :func:`create_model` is deterministic in the seed, so the model is built once per
    process and each call returns a deep copy (cheaper than re-initialising).
    """

    def build() -> nn.Module:
        return copy.deepcopy(_seeded_model(dataset, seed, arch))

    return build


def with_bn_momentum(model: nn.Module, momentum: float) -> nn.Module:
    """``model`` with every BatchNorm layer's ``momentum`` set to ``momentum`` (0: unchanged),
    returned for chaining."""
    if momentum:
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                module.momentum = momentum
    return model
