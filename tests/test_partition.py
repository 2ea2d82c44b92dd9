"""Tests of fedddl.partition: stratified/random/Dirichlet shards and shard_report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedddl.cli import main
from fedddl.partition import (
    PartitionError,
    check_shardable,
    dirichlet_shards,
    make_shards,
    random_shards,
    shard_report,
    stratified_shards,
)

METHODS = ("stratified", "random", "dirichlet")


def assert_partition(shards: list[np.ndarray], n: int) -> None:
    """Shards are sorted int64, disjoint, non-empty and cover range(n) exactly once."""
    for shard in shards:
        assert shard.dtype == np.int64
        assert shard.size > 0
        assert np.all(np.diff(shard) > 0), "indices must be sorted and unique"
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(n))


@pytest.mark.parametrize("method", METHODS)
def test_shards_are_a_reproducible_partition(method: str, imbalanced_labels: np.ndarray) -> None:
    shards = make_shards(method, imbalanced_labels, 10, seed=7, alpha=0.3)
    assert len(shards) == 10
    assert_partition(shards, imbalanced_labels.size)
    again = make_shards(method, imbalanced_labels, 10, seed=7, alpha=0.3)
    for a, b in zip(shards, again, strict=True):
        np.testing.assert_array_equal(a, b)
    other = make_shards(method, imbalanced_labels, 10, seed=8, alpha=0.3)
    assert any(not np.array_equal(a, b) for a, b in zip(shards, other, strict=True))


def test_stratified_shards_keep_class_counts_within_one(imbalanced_labels: np.ndarray) -> None:
    num_shards = 7  # does not divide the class counts, so rounding matters
    shards = stratified_shards(imbalanced_labels, num_shards, seed=3)
    classes, counts = np.unique(imbalanced_labels, return_counts=True)
    for shard in shards:
        shard_counts = np.array([np.sum(imbalanced_labels[shard] == c) for c in classes])
        assert np.all(np.abs(shard_counts - counts / num_shards) < 1.0)


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(min_value=1, max_value=60), min_size=1, max_size=6),
    data=st.data(),
)
def test_stratified_property(counts: list[int], data: st.DataObject) -> None:
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(len(counts)), counts))
    num_shards = data.draw(st.integers(min_value=1, max_value=min(counts)))
    shards = stratified_shards(labels, num_shards, seed=data.draw(st.integers(0, 2**31)))
    assert_partition(shards, labels.size)
    for c, count in enumerate(counts):
        per_shard = np.array([np.sum(labels[s] == c) for s in shards])
        assert np.all(np.abs(per_shard - count / num_shards) <= 1.0)


def test_random_shards_deviate_more_than_stratified(imbalanced_labels: np.ndarray) -> None:
    strat = shard_report(imbalanced_labels, stratified_shards(imbalanced_labels, 10))["summary"]
    rand = shard_report(imbalanced_labels, random_shards(imbalanced_labels, 10))["summary"]
    # Stratified: one sample of rounding in 200 is at most 0.005 per class.
    assert strat["max_abs_deviation_max"] <= 0.005 + 1e-12
    assert rand["max_abs_deviation_max"] > 4 * strat["max_abs_deviation_max"]
    assert rand["kl_divergence_mean"] > 10 * strat["kl_divergence_mean"]


def test_random_shards_sizes_differ_by_at_most_one() -> None:
    sizes = [s.size for s in random_shards(np.zeros(103, dtype=int), 10, seed=1)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 103


def test_dirichlet_skew_grows_as_alpha_shrinks(imbalanced_labels: np.ndarray) -> None:
    def kl(alpha: float) -> float:
        shards = dirichlet_shards(imbalanced_labels, 10, alpha=alpha, seed=0)
        return float(shard_report(imbalanced_labels, shards)["summary"]["kl_divergence_mean"])

    assert kl(0.1) > kl(1.0) > kl(100.0)
    assert kl(100.0) < 0.05


def test_dirichlet_never_leaves_a_shard_empty() -> None:
    labels = np.repeat(np.arange(3), 20)
    for seed in range(5):
        assert_partition(dirichlet_shards(labels, 40, alpha=0.01, seed=seed), labels.size)


def test_single_shard_is_everything(imbalanced_labels: np.ndarray) -> None:
    for method in METHODS:
        (only,) = make_shards(method, imbalanced_labels, 1)
        np.testing.assert_array_equal(only, np.arange(imbalanced_labels.size))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda y: stratified_shards(y, 51), "smallest class count"),
        (lambda y: stratified_shards(y, 0), "num_shards must be >= 1"),
        (lambda y: stratified_shards(np.array([], dtype=int), 2), "empty"),
        (lambda y: stratified_shards(y.reshape(2, -1), 2), "1-D"),
        (lambda y: stratified_shards(y.astype(float), 2), "integers"),
        (lambda y: random_shards(y, 2001), "exceeds the number of samples"),
        (lambda y: dirichlet_shards(y, 2, alpha=0.0), "alpha"),
        (lambda y: dirichlet_shards(y, 2, alpha=float("nan")), "alpha"),
        (lambda y: make_shards("kmeans", y, 2), "unknown partition method 'kmeans'"),
    ],
)
def test_bad_input_is_rejected(call, message: str, imbalanced_labels: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call(imbalanced_labels)


def test_non_int_num_shards_is_rejected(imbalanced_labels: np.ndarray) -> None:
    with pytest.raises(TypeError, match="num_shards must be an int"):
        random_shards(imbalanced_labels, 2.5)  # type: ignore[arg-type]


def test_shard_report_matches_hand_computation() -> None:
    labels = np.array([0, 0, 1, 1, 1, 2])
    features = np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 3.0], [6.0, 5.0], [8.0, 7.0], [10.0, 9.0]])
    shards = [np.array([0, 2]), np.array([1, 3, 4, 5])]
    report = shard_report(labels, shards, features)
    json.dumps(report)  # plain Python types only
    assert report["classes"] == [0, 1, 2]
    global_p = np.array([2, 3, 1]) / 6
    np.testing.assert_allclose(report["global"]["class_proportions"], global_p)
    first = report["shards"][0]
    assert first["size"] == 2
    np.testing.assert_allclose(first["class_proportions"], [0.5, 0.5, 0.0])
    assert first["max_abs_deviation"] == pytest.approx(abs(0.0 - 1 / 6))
    q = (np.array([0.5, 0.5, 0.0]) + 1e-10) / (1 + 3e-10)
    p = (global_p + 1e-10) / (1 + 3e-10)
    assert first["kl_divergence"] == pytest.approx(float(np.sum(q * np.log(q / p))), rel=1e-9)
    rows = features[[0, 2]]
    assert first["feature_mean"] == pytest.approx(rows.mean(axis=0).mean())
    assert first["feature_var"] == pytest.approx(rows.var(axis=0).mean())
    dev = np.abs(rows.mean(axis=0) - features.mean(axis=0)).mean()
    assert first["feature_mean_abs_dev"] == pytest.approx(dev)
    var_dev = np.abs(rows.var(axis=0) - features.var(axis=0)).mean()
    assert first["feature_var_abs_dev"] == pytest.approx(var_dev)
    summary = report["summary"]
    assert summary["disjoint"] and summary["covers_all"]
    assert summary["size_min"] == 2 and summary["size_max"] == 4
    assert summary["kl_divergence_max"] == max(s["kl_divergence"] for s in report["shards"])
    assert not math.isnan(summary["kl_divergence_mean"])


def test_shard_report_detects_overlap_and_gaps() -> None:
    summary = shard_report(np.array([0, 1, 0, 1]), [np.array([0, 1]), np.array([1, 2])])["summary"]
    assert summary["disjoint"] is False and summary["covers_all"] is False


def test_shard_report_rejects_out_of_range_indices_and_bad_features() -> None:
    with pytest.raises(ValueError, match="outside"):
        shard_report(np.array([0, 1]), [np.array([0, 2])])
    with pytest.raises(ValueError, match="features must have 2 rows"):
        shard_report(np.array([0, 1]), [np.array([0, 1])], np.zeros((3, 4)))


def test_partition_command_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["partition", "--num-shards", "5", "--method", "random", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["num_shards"] == 5 and report["summary"]["covers_all"]
    assert report["summary"]["num_samples"] == 1347
    assert "feature_mean_abs_dev_mean" in report["summary"]
    assert main(["partition", "--num-shards", "4"]) == 0
    table = capsys.readouterr().out
    assert "covers_all=True" in table and len(table.splitlines()) == 4 + 6


def test_partition_command_reports_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["partition", "--num-shards", "1000"]) == 2
    assert "smallest class count" in capsys.readouterr().err


@pytest.mark.parametrize("method", METHODS)
def test_check_shardable_agrees_with_make_shards(
    method: str, imbalanced_labels: np.ndarray
) -> None:
    limit = 50 if method == "stratified" else imbalanced_labels.size
    check_shardable(method, imbalanced_labels, limit)
    assert len(make_shards(method, imbalanced_labels, limit)) == limit
    with pytest.raises(PartitionError):
        check_shardable(method, imbalanced_labels, limit + 1)
    with pytest.raises(PartitionError):
        make_shards(method, imbalanced_labels, limit + 1)


def test_a_stratified_split_too_fine_names_the_numbers_and_the_way_out(
    imbalanced_labels: np.ndarray,
) -> None:
    with pytest.raises(PartitionError) as caught:
        check_shardable("stratified", imbalanced_labels, 51)
    message = str(caught.value)
    assert "num_shards=51" in message and "50 samples of class 4" in message
    assert 'partition = "random"' in message and "at most 50 shards" in message
