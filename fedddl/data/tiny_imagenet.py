"""Tiny ImageNet (``tiny-imagenet-200`` folder layout), loaded lazily from JPEG files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fedddl.data.errors import missing_files_error
from fedddl.data.labelled import LabelledImageDataset

__all__ = [
    "TINY_IMAGENET_URL",
    "TinyImageNetImages",
    "load_tiny_imagenet",
    "pil_to_float_tensor",
    "read_val_annotations",
]

TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
_FOLDER = "tiny-imagenet-200"


def pil_to_float_tensor(image: Any) -> torch.Tensor:
    """Convert a PIL image to an RGB float32 ``3×H×W`` tensor in [0, 1].

    Some Tiny ImageNet images are greyscale, so everything is converted to RGB.
    """
    from torchvision.transforms.functional import pil_to_tensor

    pixels: torch.Tensor = pil_to_tensor(image.convert("RGB"))
    return pixels.to(torch.float32) / 255.0


class TinyImageNetImages(LabelledImageDataset):
    """Image files read on access, each with its label.

    Parameters
    ----------
    samples : sequence of (Path, int)
        Image path and label of every sample.
    classes : sequence of str
        WordNet ids; label ``i`` is ``classes[i]``.
    """

    def __init__(self, samples: Sequence[tuple[Path, int]], classes: Sequence[str]) -> None:
        self.samples = list(samples)
        self.classes = list(classes)
        self.targets = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as image:
            return pil_to_float_tensor(image), label


def read_val_annotations(val_dir: Path, class_to_idx: dict[str, int]) -> list[tuple[Path, int]]:
    """Return ``(image path, label)`` per line of ``val_dir/val_annotations.txt``.

    Raises
    ------
    ValueError
        If a line is malformed or names a class that is not in the train split.
    """
    annotations = val_dir / "val_annotations.txt"
    samples = []
    for line_no, line in enumerate(annotations.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            raise ValueError(f"{annotations}:{line_no}: expected '<file>\\t<wnid>\\t...'")
        file_name, wnid = fields[0], fields[1]
        if wnid not in class_to_idx:
            raise ValueError(f"{annotations}:{line_no}: class {wnid!r} not in train/")
        samples.append((val_dir / "images" / file_name, class_to_idx[wnid]))
    return samples


def load_tiny_imagenet(root: Path, split: str, download: bool) -> TinyImageNetImages:
    """Load Tiny ImageNet from ``root/tiny-imagenet-200``; ``test`` is the labelled val split.

    Train images are found by ``torchvision.datasets.ImageFolder`` in
    ``train/<wnid>/images/*.JPEG``; labels are positions of the sorted WordNet ids.
    Val labels come from ``val/val_annotations.txt``.

    Raises
    ------
    DatasetNotFoundError
        If the folders are missing and ``download`` is False.
    ValueError
        If ``val_annotations.txt`` is malformed.
    """
    from torchvision.datasets import ImageFolder

    base = root / _FOLDER
    train_dir, val_dir = base / "train", base / "val"
    annotations = val_dir / "val_annotations.txt"
    if download and not (train_dir.is_dir() and annotations.is_file()):
        from torchvision.datasets.utils import download_and_extract_archive

        download_and_extract_archive(TINY_IMAGENET_URL, download_root=str(root))
    if not train_dir.is_dir() or (split == "test" and not annotations.is_file()):
        raise missing_files_error(
            "tiny-imagenet", [base], ["train/<wnid>/images/*.JPEG", "val/val_annotations.txt"]
        )
    folder = ImageFolder(str(train_dir))
    classes: list[str] = list(folder.classes)
    if split == "train":
        return TinyImageNetImages([(Path(p), int(c)) for p, c in folder.samples], classes)
    return TinyImageNetImages(read_val_annotations(val_dir, dict(folder.class_to_idx)), classes)
