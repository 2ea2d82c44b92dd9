"""Names, metadata and default locations of the supported datasets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DATASETS",
    "SPLITS",
    "DatasetInfo",
    "dataset_info",
    "default_data_root",
    "resolve_root",
]

DATASETS: tuple[str, ...] = (
    "digits",
    "mnist",
    "fashion-mnist",
    "fashion-mnist-pairs",
    "cifar10",
    "cifar100",
    "tiny-imagenet",
)
SPLITS: tuple[str, ...] = ("train", "test")


@dataclass(frozen=True)
class DatasetInfo:
    """Static description of a dataset.

    Attributes
    ----------
    name : str
        Canonical dataset name (one of :data:`DATASETS`).
    num_classes : int
        Number of label classes.
    input_shape : tuple[int, int, int]
        Shape ``(C, H, W)`` of one image tensor.
    default_model : str
        Architecture used by :func:`fedddl.models.create_model` when none is given.
    """

    name: str
    num_classes: int
    input_shape: tuple[int, int, int]
    default_model: str


_INFO: dict[str, DatasetInfo] = {
    "digits": DatasetInfo("digits", 10, (1, 8, 8), "mlp"),
    "mnist": DatasetInfo("mnist", 10, (1, 28, 28), "cnn"),
    "fashion-mnist": DatasetInfo("fashion-mnist", 10, (1, 28, 28), "cnn"),
    # Two Fashion-MNIST images side by side, 100 classes (fedddl/data/pairs.py).
    "fashion-mnist-pairs": DatasetInfo("fashion-mnist-pairs", 100, (1, 28, 56), "cnn"),
    "cifar10": DatasetInfo("cifar10", 10, (3, 32, 32), "resnet18"),
    "cifar100": DatasetInfo("cifar100", 100, (3, 32, 32), "resnet18"),
    "tiny-imagenet": DatasetInfo("tiny-imagenet", 200, (3, 64, 64), "resnet18"),
}


def check_dataset_name(name: str) -> str:
    """Return ``name`` if it is a supported dataset or a user loader, else raise ``ValueError``."""
    if name not in _INFO and ":" not in name:
        raise ValueError(
            f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)} "
            "or 'package.module:loader'"
        )
    return name


def check_split(split: str) -> str:
    """Return ``split`` if it is ``"train"`` or ``"test"``, else raise ``ValueError``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return split


def dataset_info(name: str) -> DatasetInfo:
    """Return the :class:`DatasetInfo` of dataset ``name``.

    A user loader (``"package.module:loader"``, :mod:`fedddl.data.custom`) is described
    from its training split, with ``cnn`` as the default model.

    Raises
    ------
    ValueError
        If ``name`` is not one of :data:`DATASETS` or a loadable user loader.
    """
    check_dataset_name(name)
    if ":" in name:
        from fedddl.data.custom import load_custom_info

        shape, classes = load_custom_info(name)
        return DatasetInfo(name, classes, shape, "cnn")
    return _INFO[name]


def default_data_root() -> Path:
    """Return ``$FEDDDL_DATA`` if set, else ``~/.cache/fedddl/data``."""
    env = os.environ.get("FEDDDL_DATA")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fedddl" / "data"


def resolve_root(root: str | os.PathLike[str] | None) -> Path:
    """Return ``root`` as a :class:`Path`, or :func:`default_data_root` when it is None."""
    return default_data_root() if root is None else Path(root).expanduser()
