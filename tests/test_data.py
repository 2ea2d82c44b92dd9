"""Tests of fedddl.data on small files written here in the real on-disk formats."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Subset

import fedddl.data.mnist as mnist_module
from fedddl.data import (
    DATASETS,
    DatasetNotFoundError,
    InMemoryImageDataset,
    as_tensors,
    dataset_info,
    default_data_root,
    get_labels,
    load_dataset,
)
from fedddl.data.idx_format import read_idx

DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")


def write_idx(path: Path, array: np.ndarray, type_code: int = 0x08) -> None:
    """Write ``array`` as an IDX file (gzip when the name ends in .gz)."""
    header = bytes([0, 0, type_code, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


@pytest.fixture()
def no_debian_fashion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(mnist_module, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "no-debian")


def test_dataset_info_and_names() -> None:
    assert set(DATASETS) == {
        "digits", "mnist", "fashion-mnist", "fashion-mnist-pairs", "cifar10", "cifar100",
        "tiny-imagenet"
    }  # fmt: skip
    assert dataset_info("cifar100").num_classes == 100
    assert dataset_info("tiny-imagenet").input_shape == (3, 64, 64)
    assert dataset_info("fashion-mnist").default_model == "cnn"
    with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
        dataset_info("svhn")
    with pytest.raises(ValueError, match="unknown split 'val'"):
        load_dataset("digits", split="val")


def test_default_root_honours_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDDDL_DATA", "/some/where")
    assert default_data_root() == Path("/some/where")
    monkeypatch.delenv("FEDDDL_DATA")
    assert default_data_root() == Path.home() / ".cache" / "fedddl" / "data"


def test_digits_split_is_stratified_and_complete() -> None:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    train, test = load_dataset("digits"), load_dataset("digits", split="test")
    assert (len(train), len(test)) == (1347, 450)
    image, label = train[0]
    assert image.dtype == torch.float32 and image.shape == (1, 8, 8) and isinstance(label, int)
    x_tr, y_tr = as_tensors(train)
    x_te, y_te = as_tensors(test)
    both = np.concatenate([x_tr.numpy(), x_te.numpy()]).reshape(-1, 64) * 16
    reference = bunch.images.reshape(-1, 64)
    # Same multiset of (image, label) rows as scikit-learn's data.
    ours = np.column_stack([both, np.concatenate([y_tr, y_te])])
    ref = np.column_stack([reference, bunch.target])
    np.testing.assert_array_equal(np.unique(ours, axis=0), np.unique(ref, axis=0))
    assert len(ours) == len(ref)
    ratio = np.bincount(y_te.numpy()) / np.bincount(bunch.target)
    assert np.all(np.abs(ratio - 0.25) < 0.02)
    torch.testing.assert_close(as_tensors(load_dataset("digits"))[0], x_tr, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "folder", "suffix"), [
    ("mnist", "MNIST/raw", ""),
    ("fashion-mnist", "FashionMNIST/raw", ".gz"),
    ("fashion-mnist", "fashion-mnist", ""),
])  # fmt: skip
def test_idx_loader_round_trips_pixels_and_labels(
    tmp_path: Path, name: str, folder: str, suffix: str, no_debian_fashion: None
) -> None:
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 12), ("t10k", 5)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(tmp_path / folder / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(tmp_path / folder / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    dataset = load_dataset(name, root=tmp_path, split="test")
    assert isinstance(dataset, InMemoryImageDataset) and len(dataset) == 5
    x, y = as_tensors(dataset)
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    torch.testing.assert_close(x[:, 0], torch.from_numpy(images).float() / 255, rtol=0, atol=0)
    np.testing.assert_array_equal(y.numpy(), labels)
    assert dataset.targets == labels.tolist()
    assert len(load_dataset(name, root=str(tmp_path))) == 12


def test_read_idx_other_types_and_corruption(tmp_path: Path) -> None:
    values = np.array([[1, -2, 3], [400000, 5, -6]], dtype=np.int32)
    write_idx(tmp_path / "a.idx", values, type_code=0x0C)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.idx"), values)
    good = (tmp_path / "a.idx").read_bytes()
    (tmp_path / "short.idx").write_bytes(good[:-1])
    with pytest.raises(ValueError, match="payload has 23 bytes"):
        read_idx(tmp_path / "short.idx")
    (tmp_path / "bad.idx").write_bytes(b"\x01\x02" + good[2:])
    with pytest.raises(ValueError, match="bad magic"):
        read_idx(tmp_path / "bad.idx")


def test_mismatched_idx_files_are_rejected(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    write_idx(raw / "train-images-idx3-ubyte", np.zeros((3, 28, 28), dtype=np.uint8))
    write_idx(raw / "train-labels-idx1-ubyte", np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="expected N×H×W and N"):
        load_dataset("mnist", root=tmp_path)


@pytest.mark.parametrize(("name", "where"), [
    ("mnist", "MNIST/raw"),
    ("fashion-mnist", "FashionMNIST/raw"),
    ("cifar10", "cifar-10-batches-py"),
    ("cifar100", "cifar-100-python"),
    ("tiny-imagenet", "tiny-imagenet-200"),
])  # fmt: skip
def test_missing_files_error_names_path_and_download(
    tmp_path: Path, name: str, where: str, no_debian_fashion: None
) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset(name, root=tmp_path)
    message = str(info.value)
    assert str(tmp_path / where) in message and "download=True" in message
    assert isinstance(info.value, FileNotFoundError)


def write_cifar_batch(path: Path, data: np.ndarray, labels: list[int], key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = {"batch_label": "test", "data": data, key: labels, "filenames": ["x"] * len(labels)}
    path.write_bytes(pickle.dumps(batch))


def test_cifar10_round_trips_channel_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-10-batches-py"
    train_parts = []
    for i in range(1, 6):
        data = rng.integers(0, 256, size=(3, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=3).tolist()
        write_cifar_batch(folder / f"data_batch_{i}", data, labels, "labels")
        train_parts.append((data, labels))
    data = np.zeros((2, 3072), dtype=np.uint8)
    data[0, 0] = 255  # first red value: top-left pixel, channel 0
    data[1, 1024 + 33] = 51  # a green value at row 1, column 1
    write_cifar_batch(folder / "test_batch", data, [4, 7], "labels")
    x, y = as_tensors(load_dataset("cifar10", root=tmp_path, split="test"))
    assert x.shape == (2, 3, 32, 32) and y.tolist() == [4, 7]
    assert x[0, 0, 0, 0] == 1.0 and x[1, 1, 1, 1] == pytest.approx(0.2)
    assert int(torch.count_nonzero(x)) == 2
    train = load_dataset("cifar10", root=tmp_path)
    x, y = as_tensors(train)
    expected = np.concatenate([d for d, _ in train_parts]).reshape(-1, 3, 32, 32) / 255.0
    torch.testing.assert_close(x, torch.from_numpy(expected).float(), rtol=0, atol=0)
    assert train.targets == [label for _, labels in train_parts for label in labels]


def test_cifar100_uses_fine_labels_and_bytes_keys(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    for split in ("train", "test"):
        folder.mkdir(exist_ok=True)
        # Python 2 pickles carry bytes keys.
        batch = {b"data": data, b"fine_labels": [99, 3], b"coarse_labels": [19, 1]}
        (folder / split).write_bytes(pickle.dumps(batch))
    dataset = load_dataset("cifar100", root=tmp_path, split="test")
    assert dataset.targets == [99, 3]
    x, _ = as_tensors(dataset)
    torch.testing.assert_close(
        x, torch.from_numpy(data.reshape(2, 3, 32, 32) / 255.0).float(), rtol=0, atol=0
    )


def test_malformed_cifar_batch_is_rejected(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    write_cifar_batch(folder / "train", np.zeros((2, 100), dtype=np.uint8), [0, 1], "fine_labels")
    with pytest.raises(ValueError, match="expected N×3072 and N"):
        load_dataset("cifar100", root=tmp_path)


def make_tiny_imagenet(root: Path) -> dict[str, np.ndarray]:
    """Write a 2-class tiny-imagenet-200 tree; return the pixels written per file name."""
    base = root / "tiny-imagenet-200"
    rng = np.random.default_rng(2)
    written: dict[str, np.ndarray] = {}
    wnids = ["n02", "n01"]
    (base).mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for wnid in wnids:
        folder = base / "train" / wnid / "images"
        folder.mkdir(parents=True)
        for i in range(2):
            pixels = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{wnid}_{i}.JPEG", format="JPEG")
            written[f"{wnid}_{i}.JPEG"] = pixels
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
    val_images = base / "val" / "images"
    val_images.mkdir(parents=True)
    grey = rng.integers(0, 256, size=(64, 64), dtype=np.uint8)
    Image.fromarray(grey, mode="L").save(val_images / "val_0.JPEG", format="JPEG")
    colour = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    Image.fromarray(colour).save(val_images / "val_1.JPEG", format="JPEG")
    (base / "val" / "val_annotations.txt").write_text(
        "val_0.JPEG\tn02\t0\t0\t63\t63\nval_1.JPEG\tn01\t1\t2\t40\t50\n"
    )
    return written


def decoded(path: Path) -> torch.Tensor:
    """Reference decoding: PIL → RGB → numpy HWC → CHW / 255."""
    with Image.open(path) as image:
        array = np.asarray(image.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 255


def test_tiny_imagenet_train_and_val(tmp_path: Path) -> None:
    make_tiny_imagenet(tmp_path)
    base = tmp_path / "tiny-imagenet-200"
    train = load_dataset("tiny-imagenet", root=tmp_path)
    assert len(train) == 4 and list(train.targets) == [0, 0, 1, 1]  # sorted wnids: n01, n02
    image, label = train[2]
    assert image.shape == (3, 64, 64) and image.dtype == torch.float32 and label == 1
    ref = decoded(base / "train" / "n02" / "images" / "n02_0.JPEG")
    torch.testing.assert_close(image, ref, rtol=0, atol=0)
    val = load_dataset("tiny-imagenet", root=tmp_path, split="test")
    assert val.targets == [1, 0]
    x, y = as_tensors(val)
    assert x.shape == (2, 3, 64, 64) and y.tolist() == [1, 0]
    torch.testing.assert_close(x[0], decoded(base / "val" / "images" / "val_0.JPEG"))
    torch.testing.assert_close(x[0, 0], x[0, 2])  # greyscale expanded to RGB
    np.testing.assert_array_equal(get_labels(Subset(val, [1])), [0])


def test_tiny_imagenet_bad_annotations(tmp_path: Path) -> None:
    make_tiny_imagenet(tmp_path)
    annotations = tmp_path / "tiny-imagenet-200" / "val" / "val_annotations.txt"
    annotations.write_text("val_0.JPEG\tn99\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match="class 'n99' not in train"):
        load_dataset("tiny-imagenet", root=tmp_path, split="test")
    annotations.unlink()
    with pytest.raises(DatasetNotFoundError, match=r"val_annotations\.txt"):
        load_dataset("tiny-imagenet", root=tmp_path, split="test")


def test_in_memory_dataset_validates() -> None:
    with pytest.raises(ValueError, match="N×C×H×W"):
        InMemoryImageDataset(torch.zeros(2, 8, 8), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="labels must be 1-D with 2 entries"):
        InMemoryImageDataset(torch.zeros(2, 1, 8, 8), torch.zeros(3, dtype=torch.int64))


@pytest.mark.skipif(not DEBIAN_FASHION.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist_from_debian(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDDDL_DATA", str(tmp_path))  # empty root → Debian files are used
    train = load_dataset("fashion-mnist")
    test = load_dataset("fashion-mnist", root=tmp_path, split="test")
    assert (len(train), len(test)) == (60000, 10000)
    x, _ = as_tensors(train)
    assert x.shape == (60000, 1, 28, 28) and 0.0 <= float(x.min()) < float(x.max()) <= 1.0
    # Fashion-MNIST is exactly balanced: 6000 / 1000 images per class.
    assert np.bincount(get_labels(train)).tolist() == [6000] * 10
    assert np.bincount(get_labels(test)).tolist() == [1000] * 10
    assert dataset_info("fashion-mnist").input_shape == tuple(x.shape[1:])


class _PlainDataset(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A dataset without ``targets``: helpers must fall back to iterating."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((1, 2, 2), float(index)), 2 - index


def test_helpers_fall_back_to_iteration() -> None:
    np.testing.assert_array_equal(get_labels(_PlainDataset()), [2, 1, 0])
    x, y = as_tensors(_PlainDataset())
    assert (
        x.shape == (3, 1, 2, 2)
        and x.dtype == torch.float32
        and torch.equal(x[2, 0, 1, 1], torch.tensor(2.0))
    )
    assert y.tolist() == [2, 1, 0] and y.dtype == torch.int64
    np.testing.assert_array_equal(get_labels(Subset(_PlainDataset(), [2, 0])), [0, 2])
    with pytest.raises(ValueError, match="empty dataset"):
        as_tensors(Subset(_PlainDataset(), []))


def test_fashion_mnist_pairs_are_two_real_images_with_a_product_label(
    tmp_path: Path, no_debian_fashion: None
) -> None:
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 40), ("t10k", 15)):
        write_idx(tmp_path / "fashion-mnist" / f"{prefix}-images-idx3-ubyte",
                  rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / "fashion-mnist" / f"{prefix}-labels-idx1-ubyte",
                  rng.integers(0, 10, size=n, dtype=np.uint8))
    info = dataset_info("fashion-mnist-pairs")
    assert (info.num_classes, info.input_shape) == (100, (1, 28, 56))
    for split, n in (("train", 40), ("test", 15)):
        source_x, source_y = as_tensors(load_dataset("fashion-mnist", root=tmp_path, split=split))
        pairs = load_dataset("fashion-mnist-pairs", root=tmp_path, split=split)
        x, y = as_tensors(pairs)
        assert x.shape == (n, 1, 28, 56) and len(pairs.targets) == n
        left, right = x[..., :28], x[..., 28:]
        torch.testing.assert_close(left, source_x, rtol=0, atol=0)  # image i on the left
        # Every source image is the right half of exactly one pair, with its own label.
        match = [int(torch.nonzero((source_x == r).flatten(1).all(1))[0]) for r in right]
        assert sorted(match) == list(range(n))
        assert match != list(range(n))  # a real permutation, not the identity
        np.testing.assert_array_equal(y.numpy(), 10 * source_y.numpy() + source_y.numpy()[match])
        again = load_dataset("fashion-mnist-pairs", root=tmp_path, split=split)
        assert again.targets == pairs.targets  # the same pairs everywhere
