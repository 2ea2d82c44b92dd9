"""quickstart_compressed: the model, data and training of Flower's PyTorch quickstart.

The ``Net``, ``train`` and ``test`` of Flower's ``quickstart-pytorch`` (a small CNN for
3x32x32 images, SGD with momentum), on Fashion-MNIST instead of CIFAR-10 so that it runs
offline: fedddl's loader finds the dataset in ``$FEDDDL_DATA`` or Debian's
``dataset-fashion-mnist`` package, the 28x28 grey images are padded to 32x32 and repeated
over 3 channels. Nodes get stratified shards (fedddl's ``stratified_shards``) of a
stratified subset of the training split, ``samples`` images each; 80 % train, 20 % test.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedddl.data import as_tensors, load_dataset
from fedddl.partition import stratified_shards


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz'), as in the quickstart."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


@lru_cache(maxsize=2)
def _split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST ``split`` as (N x 1 x 28 x 28 float32 in [0, 1], N int64), no download."""
    return as_tensors(load_dataset("fashion-mnist", split=split))


def _to_3x32x32(images: torch.Tensor) -> torch.Tensor:
    """Pad 28x28 to 32x32, repeat over 3 channels, normalise to [-1, 1] (the quickstart's
    ``Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))``)."""
    padded = F.pad(images, (2, 2, 2, 2))
    return ((padded - 0.5) / 0.5).repeat(1, 3, 1, 1).contiguous()


def _stratified_subset(labels: torch.Tensor, size: int, seed: int) -> np.ndarray:
    """Indices of a stratified subset of at least ``size`` of ``labels`` (all if fewer)."""
    parts = max(1, len(labels) // max(size, 1))
    return stratified_shards(labels.numpy(), parts, seed=seed)[0]


def partition(
    partition_id: int, num_partitions: int, samples: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The images and labels of node ``partition_id``: about ``samples`` of them."""
    images, labels = _split("train")
    subset = _stratified_subset(labels, samples * num_partitions, seed)
    shards = stratified_shards(labels[subset].numpy(), num_partitions, seed=seed)
    shard = subset[shards[partition_id]][:samples]
    return _to_3x32x32(images[shard]), labels[shard]


def load_data(
    partition_id: int, num_partitions: int, batch_size: int, samples: int
) -> tuple[DataLoader[tuple[torch.Tensor, ...]], DataLoader[tuple[torch.Tensor, ...]]]:
    """Train and test loaders of node ``partition_id`` (80 % / 20 % of its shard)."""
    x, y = partition(partition_id, num_partitions, samples)
    cut = int(0.8 * len(y))
    generator = torch.Generator().manual_seed(42 + partition_id)
    order = torch.randperm(len(y), generator=generator)
    train_part, test_part = order[:cut], order[cut:]
    trainloader = DataLoader(
        TensorDataset(x[train_part], y[train_part]),
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
    )
    testloader = DataLoader(TensorDataset(x[test_part], y[test_part]), batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset(samples: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    """A stratified subset of about ``samples`` images of the test split."""
    images, labels = _split("test")
    subset = _stratified_subset(labels, samples, seed=0)
    return DataLoader(TensorDataset(_to_3x32x32(images[subset]), labels[subset]), batch_size=500)


def train(
    net: nn.Module,
    trainloader: DataLoader[tuple[torch.Tensor, ...]],
    epochs: int,
    lr: float,
    device: torch.device,
) -> float:
    """Train the model on the training set; the mean training loss."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(
    net: nn.Module, testloader: DataLoader[tuple[torch.Tensor, ...]], device: torch.device
) -> tuple[float, float]:
    """Validate the model on the test set: (mean loss, accuracy)."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            labels = labels.to(device)
            loss += criterion(outputs, labels).item()
            correct += int((outputs.argmax(1) == labels).sum().item())
    return loss / len(testloader), correct / len(testloader.dataset)  # type: ignore[arg-type]
