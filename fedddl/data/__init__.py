"""Datasets: one loader for digits, MNIST, Fashion-MNIST (and its 100-class pairs), CIFAR-10/100
and Tiny ImageNet."""

from fedddl.data.errors import DatasetNotFoundError
from fedddl.data.in_memory import InMemoryImageDataset
from fedddl.data.labelled import LabelledImageDataset
from fedddl.data.loader import load_dataset
from fedddl.data.registry import (
    DATASETS,
    SPLITS,
    DatasetInfo,
    dataset_info,
    default_data_root,
)
from fedddl.data.tensors import as_tensors, get_labels

__all__ = [
    "DATASETS",
    "SPLITS",
    "DatasetInfo",
    "DatasetNotFoundError",
    "InMemoryImageDataset",
    "LabelledImageDataset",
    "as_tensors",
    "dataset_info",
    "default_data_root",
    "get_labels",
    "load_dataset",
]
