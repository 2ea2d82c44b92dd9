"""scikit-learn's bundled handwritten digits (8×8), the offline default dataset."""

from __future__ import annotations

import numpy as np
import torch

from fedddl.data.in_memory import InMemoryImageDataset

__all__ = ["DIGITS_SPLIT_SEED", "DIGITS_TEST_FRACTION", "load_digits_split"]

DIGITS_TEST_FRACTION = 0.25
DIGITS_SPLIT_SEED = 0


def load_digits_split(split: str) -> InMemoryImageDataset:
    """Return the train or test part of ``sklearn.datasets.load_digits``.

    The split is stratified, 25 % test, with a fixed seed, so it is the same everywhere.
    Pixels (0..16) are scaled to [0, 1]; images are ``1×8×8``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / 16.0
    labels = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(labels.shape[0]),
        test_size=DIGITS_TEST_FRACTION,
        stratify=labels,
        random_state=DIGITS_SPLIT_SEED,
    )
    idx = np.sort(train_idx if split == "train" else test_idx)
    pixels = torch.from_numpy(np.ascontiguousarray(images[idx])).unsqueeze(1)
    return InMemoryImageDataset(pixels, torch.from_numpy(labels[idx]), name="digits")
