"""The single entry point :func:`load_dataset`."""

from __future__ import annotations

import os

from fedddl.data.labelled import LabelledImageDataset
from fedddl.data.registry import check_dataset_name, check_split, resolve_root

__all__ = ["load_dataset"]


def load_dataset(
    name: str,
    root: str | os.PathLike[str] | None = None,
    split: str = "train",
    download: bool = False,
) -> LabelledImageDataset:
    """Load a dataset split; every item is ``(float32 C×H×W image in [0, 1], int label)``.

    Parameters
    ----------
    name : str
        One of :data:`fedddl.data.DATASETS`, or your own ``"package.module:loader"``
        (see :mod:`fedddl.data.custom`).
    root : str, PathLike or None
        Data directory; None means ``$FEDDDL_DATA`` or ``~/.cache/fedddl/data``.
        Ignored by ``digits`` (bundled with scikit-learn). Fashion-MNIST falls back to
        Debian's ``/usr/share/datasets/fashion-mnist`` when ``root`` has no files;
        ``fashion-mnist-pairs`` is built from Fashion-MNIST (:mod:`fedddl.data.pairs`).
    split : str
        ``"train"`` or ``"test"`` (Tiny ImageNet's ``test`` is its labelled val split).
    download : bool
        Fetch missing files through torchvision (needs network).

    Returns
    -------
    LabelledImageDataset
        A ``torch.utils.data.Dataset`` with ``len`` and a ``targets`` list. All but
        Tiny ImageNet are :class:`~fedddl.data.InMemoryImageDataset` (tensors in memory).

    Raises
    ------
    ValueError
        On an unknown name or split, or malformed files.
    DatasetNotFoundError
        If the files are missing and ``download`` is False; the message names the
        directories searched and suggests ``download=True``.
    """
    check_dataset_name(name)
    check_split(split)
    if ":" in name:
        from fedddl.data.custom import load_custom

        return load_custom(name, split, None if root is None else str(root))
    if name == "digits":
        from fedddl.data.digits import load_digits_split

        return load_digits_split(split)
    data_root = resolve_root(root)
    if name in ("mnist", "fashion-mnist"):
        from fedddl.data.mnist import load_mnist_like

        return load_mnist_like(name, data_root, split, download)
    if name == "fashion-mnist-pairs":
        from fedddl.data.pairs import load_fashion_mnist_pairs

        return load_fashion_mnist_pairs(data_root, split, download)
    if name in ("cifar10", "cifar100"):
        from fedddl.data.cifar import load_cifar

        return load_cifar(name, data_root, split, download)
    from fedddl.data.tiny_imagenet import load_tiny_imagenet

    return load_tiny_imagenet(data_root, split, download)
