"""Your own data: ``dataset = "package.module:loader"``.

``loader(split: str, root: str | None)`` returns the split (``"train"`` or ``"test"``) as
an ``(images N×C×H×W float32, labels N int64)`` pair of tensors, or as any
:class:`~fedddl.data.LabelledImageDataset`. fedddl derives the input shape from the
images and the number of classes from the largest training label (or the loader's
``num_classes`` attribute, when it has one); the default model is ``cnn``.

The loader runs in the server and in every client: it must return the same data there.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from fedddl.data.in_memory import InMemoryImageDataset
from fedddl.data.labelled import LabelledImageDataset
from fedddl.import_spec import import_attribute

__all__ = ["is_custom", "load_custom", "load_custom_info"]


def is_custom(name: str) -> bool:
    """Whether ``name`` names a user loader (``"package.module:loader"``)."""
    return ":" in name


def _loader(spec: str) -> Callable[..., Any]:
    loader, module_name, attr = import_attribute(spec, "dataset", "package.module:loader")
    if not callable(loader):
        raise ValueError(f"dataset {spec!r}: {attr!r} is not a callable in {module_name!r}")
    return loader  # type: ignore[no-any-return]


def load_custom(spec: str, split: str, root: str | None) -> LabelledImageDataset:
    """Call the user's loader and check what it returns.

    Raises
    ------
    ValueError
        Naming what is wrong with the spec or the returned data.
    """
    data = _loader(spec)(split, root)
    if isinstance(data, LabelledImageDataset):
        return data
    if not (isinstance(data, tuple) and len(data) == 2):
        raise ValueError(
            f"dataset {spec!r} returned {type(data).__name__}; expected (images, labels) "
            "tensors or a LabelledImageDataset"
        )
    images, labels = data
    if not isinstance(images, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise ValueError(f"dataset {spec!r} must return tensors")
    if bool(labels.numel()) and int(labels.min()) < 0:
        raise ValueError(f"dataset {spec!r} has negative labels")
    return InMemoryImageDataset(images, labels, name=spec)


@lru_cache(maxsize=8)
def load_custom_info(spec: str) -> tuple[tuple[int, int, int], int]:
    """``(input_shape, num_classes)`` of a user dataset, from its training split."""
    train = load_custom(spec, "train", None)
    image, _ = train[0]
    shape = tuple(int(d) for d in image.shape)
    if len(shape) != 3:
        raise ValueError(f"dataset {spec!r}: images must be C×H×W, got {shape}")
    declared = getattr(_loader(spec), "num_classes", None)
    num_classes = int(declared) if declared is not None else max(train.targets) + 1
    return (shape[0], shape[1], shape[2]), num_classes
