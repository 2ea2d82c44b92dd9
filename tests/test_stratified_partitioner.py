"""``fedddl.flower.stratified_partitioner.StratifiedPartitioner`` with Flower Datasets, offline."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr_datasets")

from datasets import Dataset
from sklearn.datasets import load_digits

from fedddl.flower.stratified_partitioner import StratifiedPartitioner
from fedddl.partition import stratified_shards

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits() -> Dataset:
    data = load_digits()
    return Dataset.from_dict({"pixels": data.data.tolist(), "label": data.target.tolist()})


def _class_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.bincount(labels, minlength=num_classes)


def test_is_a_flower_datasets_partitioner() -> None:
    from flwr_datasets.partitioner import Partitioner

    assert issubclass(StratifiedPartitioner, Partitioner)
    assert StratifiedPartitioner(7).num_partitions == 7


def test_partitions_keep_the_class_mix_and_cover_everything(digits: Dataset) -> None:
    partitioner = StratifiedPartitioner(num_partitions=10, partition_by="label", seed=3)
    partitioner.dataset = digits
    labels = np.asarray(digits["label"])
    totals = _class_counts(labels, 10)
    seen: list[int] = []
    for k in range(10):
        part = partitioner.load_partition(k)
        counts = _class_counts(np.asarray(part["label"]), 10)
        # per class: floor or ceil of count / 10 -- a random split would miss this
        assert np.all(counts >= totals // 10) and np.all(counts <= -(-totals // 10)), k
        seen.extend(partitioner.partition_id_to_indices[k])
        assert part["pixels"][0] == digits[partitioner.partition_id_to_indices[k][0]]["pixels"]
    assert sorted(seen) == list(range(len(digits)))


def test_same_split_as_stratified_shards(digits: Dataset) -> None:
    partitioner = StratifiedPartitioner(5, seed=1)
    partitioner.dataset = digits
    expected = stratified_shards(np.asarray(digits["label"]), 5, seed=1)
    for k in range(5):
        assert partitioner.partition_id_to_indices[k] == expected[k].tolist()


def test_string_labels_and_another_column() -> None:
    names = ["cat", "dog", "eel"] * 20 + ["cat"] * 6
    data = Dataset.from_dict({"animal": names, "x": list(range(len(names)))})
    partitioner = StratifiedPartitioner(3, partition_by="animal")
    partitioner.dataset = data
    for k in range(3):
        part = partitioner.load_partition(k)["animal"]
        assert sorted(set(part)) == ["cat", "dog", "eel"]
        assert list(part).count("cat") in (8, 9) and list(part).count("dog") in (6, 7)


def test_bad_input_is_a_clear_error(digits: Dataset) -> None:
    with pytest.raises(ValueError, match="num_partitions must be >= 1"):
        StratifiedPartitioner(0)
    partitioner = StratifiedPartitioner(3, partition_by="class")
    partitioner.dataset = digits
    with pytest.raises(ValueError, match="'class' is not a column"):
        partitioner.load_partition(0)
    too_many = StratifiedPartitioner(500)
    too_many.dataset = digits
    with pytest.raises(ValueError, match="smallest class count"):
        too_many.load_partition(0)
    ok = StratifiedPartitioner(3)
    ok.dataset = digits
    with pytest.raises(ValueError, match=r"partition_id must be in \[0, 3\)"):
        ok.load_partition(3)


def test_works_inside_federated_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``FederatedDataset(..., partitioners={"train": StratifiedPartitioner(...)})`` offline:
    a local parquet file through the ``datasets`` packaged loader, no hub access."""
    from flwr_datasets import FederatedDataset

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = load_digits()
    path = tmp_path / "digits.parquet"
    Dataset.from_dict({"pixels": data.data.tolist(), "label": data.target.tolist()}).to_parquet(
        str(path)
    )
    fds = FederatedDataset(
        dataset="parquet",
        data_files={"train": str(path)},
        partitioners={"train": StratifiedPartitioner(num_partitions=8, seed=0)},
        cache_dir=str(tmp_path / "cache"),
    )
    totals = _class_counts(data.target, 10)
    sizes = []
    for k in range(8):
        part = fds.load_partition(k)
        counts = _class_counts(np.asarray(part["label"]), 10)
        assert np.all(np.abs(counts - totals / 8) < 1), k
        sizes.append(len(part))
    assert sum(sizes) == len(data.target)


def test_core_does_not_need_flwr_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fedddl.partition`` does not import flwr-datasets or the Flower layer; its old
    ``StratifiedPartitioner`` name says where the class lives now."""
    import ast
    import importlib

    source = (ROOT / "fedddl" / "partition.py").read_text()
    top_level = [n for n in ast.parse(source).body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not any("stratified_partitioner" in ast.dump(n) for n in top_level)
    for name in [m for m in sys.modules if m.split(".")[0] == "flwr_datasets"]:
        monkeypatch.setitem(sys.modules, name, None)  # "not installed"
    monkeypatch.delitem(sys.modules, "fedddl.flower.stratified_partitioner")
    partition = importlib.import_module("fedddl.partition")
    assert partition.stratified_shards([0, 1, 0, 1], 2)
    moved = r"import it from fedddl\.flower\.stratified_partitioner"
    with pytest.raises(AttributeError, match=moved):
        _ = partition.StratifiedPartitioner
