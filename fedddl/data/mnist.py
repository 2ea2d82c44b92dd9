"""MNIST and Fashion-MNIST from their IDX files (plain or ``.gz``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedddl.data.errors import missing_files_error
from fedddl.data.idx_format import read_idx
from fedddl.data.in_memory import InMemoryImageDataset

__all__ = ["DEBIAN_FASHION_MNIST_DIR", "idx_file_names", "load_mnist_like"]

# Debian's dataset-fashion-mnist package ships the original gzipped IDX files here.
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# Our name -> torchvision class, whose download writes to root/<Class>/raw/.
_TORCHVISION_CLASS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}


def idx_file_names(split: str) -> tuple[str, str]:
    """Return the (images, labels) IDX base names of ``split`` without ``.gz``."""
    prefix = "train" if split == "train" else "t10k"
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def _candidate_dirs(name: str, root: Path) -> list[Path]:
    dirs = [root / _TORCHVISION_CLASS[name] / "raw", root / name]
    if name == "fashion-mnist":
        dirs.append(DEBIAN_FASHION_MNIST_DIR)
    return dirs


def _find(directory: Path, base: str) -> Path | None:
    for candidate in (directory / base, directory / f"{base}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _locate(name: str, root: Path, split: str) -> tuple[Path, Path] | None:
    images_base, labels_base = idx_file_names(split)
    for directory in _candidate_dirs(name, root):
        images, labels = _find(directory, images_base), _find(directory, labels_base)
        if images is not None and labels is not None:
            return images, labels
    return None


def _download(name: str, root: Path) -> None:
    from torchvision import datasets

    cls = datasets.MNIST if name == "mnist" else datasets.FashionMNIST
    for train in (True, False):
        cls(str(root), train=train, download=True)


def load_mnist_like(name: str, root: Path, split: str, download: bool) -> InMemoryImageDataset:
    """Load ``mnist`` or ``fashion-mnist`` into memory as ``N×1×28×28`` floats in [0, 1].

    Files are looked for, in order, in ``root/<MNIST|FashionMNIST>/raw/`` (torchvision's
    layout), ``root/<name>/`` and, for Fashion-MNIST, Debian's
    ``/usr/share/datasets/fashion-mnist/``.

    Raises
    ------
    DatasetNotFoundError
        If the files are missing and ``download`` is False.
    ValueError
        If the files are malformed or images and labels disagree.
    """
    found = _locate(name, root, split)
    if found is None and download:
        _download(name, root)
        found = _locate(name, root, split)
    if found is None:
        raise missing_files_error(
            name, _candidate_dirs(name, root), [f"{b}[.gz]" for b in idx_file_names(split)]
        )
    images_path, labels_path = found
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{name}: images {images_path} have shape {images.shape} but labels "
            f"{labels_path} have shape {labels.shape}; expected N×H×W and N"
        )
    pixels = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)) / 255.0
    targets = torch.from_numpy(labels.astype(np.int64))
    return InMemoryImageDataset(pixels.unsqueeze(1), targets, name=name)
