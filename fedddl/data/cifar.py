"""CIFAR-10 / CIFAR-100 from the official "python version" pickled batches."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedddl.data.errors import missing_files_error
from fedddl.data.in_memory import InMemoryImageDataset

__all__ = ["cifar_layout", "load_cifar"]


def cifar_layout(name: str, split: str) -> tuple[str, list[str], str]:
    """Return (folder under root, batch file names, label key) for a CIFAR split."""
    if name == "cifar10":
        files = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        return "cifar-10-batches-py", files, "labels"
    return "cifar-100-python", ["train" if split == "train" else "test"], "fine_labels"


def _field(batch: dict[Any, Any], key: str, path: Path) -> Any:
    # Batches pickled by Python 2 may carry bytes keys.
    for candidate in (key, key.encode()):
        if candidate in batch:
            return batch[candidate]
    raise ValueError(f"{path}: CIFAR batch has no {key!r} entry")


def _read_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    # The official format is a pickle; only load files from sources you trust.
    with path.open("rb") as handle:
        batch = pickle.load(handle, encoding="latin1")
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: not a CIFAR batch (expected a pickled dict)")
    data = np.asarray(_field(batch, "data", path), dtype=np.uint8)
    labels = np.asarray(_field(batch, label_key, path), dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{path}: data shape {data.shape} and {labels.shape[0]} labels; expected N×3072 and N"
        )
    return data, labels


def _download(name: str, root: Path) -> None:
    from torchvision import datasets

    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    for train in (True, False):
        cls(str(root), train=train, download=True)


def load_cifar(name: str, root: Path, split: str, download: bool) -> InMemoryImageDataset:
    """Load ``cifar10`` or ``cifar100`` into memory as ``N×3×32×32`` floats in [0, 1].

    Reads ``root/cifar-10-batches-py/{data_batch_1..5,test_batch}`` or
    ``root/cifar-100-python/{train,test}`` (torchvision's download layout). Labels of
    CIFAR-100 are the 100 fine labels.

    Raises
    ------
    DatasetNotFoundError
        If a batch file is missing and ``download`` is False.
    ValueError
        If a batch file is malformed.
    """
    folder, files, label_key = cifar_layout(name, split)
    directory = root / folder
    paths = [directory / f for f in files]
    if download and not all(p.is_file() for p in paths):
        _download(name, root)
    if not all(p.is_file() for p in paths):
        raise missing_files_error(name, [directory], files)
    parts = [_read_batch(p, label_key) for p in paths]
    data = np.concatenate([d for d, _ in parts])
    labels = np.concatenate([lab for _, lab in parts])
    # Rows are 1024 red, then green, then blue values, each row-major 32×32.
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).astype(np.float32)) / 255.0
    return InMemoryImageDataset(images, torch.from_numpy(labels), name=name)
