"""Split sample indices into disjoint shards: stratified, random or Dirichlet non-IID.

Every function returns a list of sorted int64 index arrays that are disjoint and
together cover ``range(len(labels))`` exactly once; the same seed gives the same shards.

The same stratified split as a Flower Datasets ``Partitioner`` is
:class:`fedddl.flower.stratified_partitioner.StratifiedPartitioner` (Flower layer; needs the
optional ``flwr-datasets``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "PARTITION_METHODS",
    "PartitionError",
    "check_shardable",
    "dirichlet_shards",
    "make_shards",
    "random_shards",
    "shard_report",
    "stratified_shards",
]

PARTITION_METHODS: tuple[str, ...] = ("stratified", "random", "dirichlet")
_KL_EPSILON = 1e-10
_FEATURE_CHUNK_ROWS = 8192


class PartitionError(ValueError):
    """A split the labels cannot give: more shards than samples, or (stratified) than the
    smallest class has samples."""


def __getattr__(name: str) -> Any:
    """Name the new home of ``StratifiedPartitioner`` (it moved to the Flower layer)."""
    if name == "StratifiedPartitioner":
        raise AttributeError(
            "fedddl.partition.StratifiedPartitioner moved: import it from "
            "fedddl.flower.stratified_partitioner (needs pip install 'fedddl[datasets]')"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_labels(labels: ArrayLike) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {array.shape}")
    if array.size == 0:
        raise ValueError("labels is empty; nothing to partition")
    if not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
        raise ValueError(f"labels must be integers (class ids), got dtype {array.dtype}")
    return array


def _check_num_shards(num_shards: int, num_samples: int) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)):
        raise TypeError(f"num_shards must be an int, got {type(num_shards).__name__}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards > num_samples:
        raise PartitionError(
            f"num_shards={num_shards} exceeds the number of samples ({num_samples})"
        )
    return int(num_shards)


def _check_stratifiable(y: np.ndarray, k: int) -> None:
    classes, counts = np.unique(y, return_counts=True)
    smallest = int(counts.min())
    if k > smallest:
        rare = classes[counts.argmin()]
        raise PartitionError(
            f"num_shards={k} exceeds the smallest class count ({smallest} samples of class "
            f"{rare}); a stratified split needs every class in every shard: use at most "
            f"{smallest} shards, or partition = \"random\" (or \"dirichlet\")"
        )


def check_shardable(method: str, labels: ArrayLike, num_shards: int) -> None:
    """Raise unless ``make_shards(method, labels, num_shards)`` can split ``labels``.

    Raises
    ------
    PartitionError
        If ``num_shards`` exceeds the sample count, or for ``"stratified"`` the smallest
        class count (the message names both numbers and the way out).
    ValueError
        On an unknown method, labels that are empty or not 1-D, or ``num_shards`` < 1.
    TypeError
        If ``num_shards`` is not an int.
    """
    if method not in PARTITION_METHODS:
        raise ValueError(
            f"unknown partition method {method!r}; expected one of {', '.join(PARTITION_METHODS)}"
        )
    y = _check_labels(labels)
    k = _check_num_shards(num_shards, y.size)
    if method == "stratified":
        _check_stratifiable(y, k)


def _sorted(shards: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]


def stratified_shards(labels: ArrayLike, num_shards: int, *, seed: int = 0) -> list[np.ndarray]:
    """Split 1-D int ``labels`` into ``num_shards`` shards that keep the global class proportions.

    Built on ``sklearn.model_selection.StratifiedKFold(shuffle=True, random_state=seed)``:
    the test indices of fold ``k`` form shard ``k`` (sorted int64 index arrays), so each
    class's count in every shard is ``floor`` or ``ceil`` of ``count / num_shards``.

    Raises
    ------
    ValueError
        If labels are empty or not 1-D, or ``num_shards`` is < 1; a ``PartitionError`` if it
        exceeds the smallest class count.
    """
    y = _check_labels(labels)
    k = _check_num_shards(num_shards, y.size)
    _check_stratifiable(y, k)
    if k == 1:  # StratifiedKFold needs >= 2 folds; one shard is everything.
        return [np.arange(y.size, dtype=np.int64)]
    from sklearn.model_selection import StratifiedKFold

    folds = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    return _sorted([test for _, test in folds.split(np.zeros((y.size, 1)), y)])


def random_shards(labels: ArrayLike, num_shards: int, *, seed: int = 0) -> list[np.ndarray]:
    """Random-sampling baseline: a seeded permutation split into near-equal parts.

    Raises
    ------
    ValueError
        If labels are empty or not 1-D, or ``num_shards`` is < 1 or exceeds the sample count.
    """
    y = _check_labels(labels)
    k = _check_num_shards(num_shards, y.size)
    permutation = np.random.default_rng(seed).permutation(y.size)
    return _sorted(np.array_split(permutation, k))


def dirichlet_shards(
    labels: ArrayLike, num_shards: int, *, alpha: float, seed: int = 0
) -> list[np.ndarray]:
    """Non-IID baseline: each class is spread over shards by ``Dirichlet(alpha)`` proportions.

    Small ``alpha`` gives skewed shards, large ``alpha`` approaches an IID split. A shard
    left empty by the draw receives one sample taken from the largest shard, so no shard
    is empty.

    Raises
    ------
    ValueError
        If labels are empty or not 1-D, ``num_shards`` is < 1 or exceeds the sample count,
        or ``alpha`` is not a positive finite number.
    """
    y = _check_labels(labels)
    k = _check_num_shards(num_shards, y.size)
    try:
        concentration = float(alpha)
    except (TypeError, ValueError):
        concentration = float("nan")
    if isinstance(alpha, (bool, str)) or not (math.isfinite(concentration) and concentration > 0):
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for cls in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == cls))
        proportions = rng.dirichlet(np.full(k, concentration))
        cuts = (np.cumsum(proportions)[:-1] * members.size).astype(np.int64)
        for shard, chunk in zip(parts, np.split(members, cuts), strict=True):
            shard.append(chunk)
    shards = [np.concatenate(p) for p in parts]
    for empty in [i for i, s in enumerate(shards) if s.size == 0]:
        donor = int(np.argmax([s.size for s in shards]))
        pick = int(rng.integers(shards[donor].size))
        shards[empty] = shards[donor][pick : pick + 1]
        shards[donor] = np.delete(shards[donor], pick)
    return _sorted(shards)


def make_shards(
    method: str, labels: ArrayLike, num_shards: int, *, seed: int = 0, alpha: float = 0.5
) -> list[np.ndarray]:
    """Dispatch to a partitioner by name: ``"stratified"``, ``"random"`` or ``"dirichlet"``.

    ``alpha`` is used by ``"dirichlet"`` only.

    Raises
    ------
    ValueError
        On an unknown method, or whatever the chosen partitioner rejects.
    """
    partitioners: dict[str, Callable[[], list[np.ndarray]]] = {
        "stratified": lambda: stratified_shards(labels, num_shards, seed=seed),
        "random": lambda: random_shards(labels, num_shards, seed=seed),
        "dirichlet": lambda: dirichlet_shards(labels, num_shards, alpha=alpha, seed=seed),
    }
    if method not in partitioners:
        raise ValueError(
            f"unknown partition method {method!r}; expected one of {', '.join(PARTITION_METHODS)}"
        )
    return partitioners[method]()


def _feature_moments(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and (population) variance over ``rows``, in float64, in chunks."""
    total = np.zeros(x.shape[1], dtype=np.float64)
    for start in range(0, rows.size, _FEATURE_CHUNK_ROWS):
        total += x[rows[start : start + _FEATURE_CHUNK_ROWS]].sum(axis=0, dtype=np.float64)
    mean = total / rows.size
    squares = np.zeros(x.shape[1], dtype=np.float64)
    for start in range(0, rows.size, _FEATURE_CHUNK_ROWS):
        centred = x[rows[start : start + _FEATURE_CHUNK_ROWS]].astype(np.float64) - mean
        squares += np.einsum("ij,ij->j", centred, centred)
    return mean, squares / rows.size


def _kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) after adding a small epsilon to both and renormalising."""
    p = (p + _KL_EPSILON) / (p + _KL_EPSILON).sum()
    q = (q + _KL_EPSILON) / (q + _KL_EPSILON).sum()
    return float(np.sum(p * np.log(p / q)))


def _check_shards(shards: Sequence[ArrayLike], num_samples: int) -> list[np.ndarray]:
    if len(shards) == 0:
        raise ValueError("shards is empty")
    checked = []
    for i, shard in enumerate(shards):
        idx = np.asarray(shard)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"shard {i} must be a 1-D integer index array, got {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= num_samples):
            raise ValueError(f"shard {i} has indices outside [0, {num_samples})")
        checked.append(idx.astype(np.int64))
    return checked


def shard_report(
    labels: ArrayLike, shards: Sequence[ArrayLike], features: ArrayLike | None = None
) -> dict[str, Any]:
    """Describe how far each shard's label (and feature) distribution is from the global one.

    Parameters
    ----------
    labels : array_like of int
        1-D labels of the whole dataset.
    shards : sequence of array_like of int
        Index arrays into ``labels``.
    features : array_like, optional
        ``N×...`` features (e.g. images); flattened per sample. When given, each shard
        reports ``feature_mean`` / ``feature_var`` (mean over features of the per-feature
        mean / variance) and ``feature_mean_abs_dev`` / ``feature_var_abs_dev`` (mean over
        features of the absolute difference to the global per-feature value).

    Returns
    -------
    dict
        JSON-serialisable: ``{"classes", "global": {...}, "shards": [...], "summary": {...}}``.
        Each shard has ``size``, ``class_proportions`` (aligned with ``classes``),
        ``max_abs_deviation`` and ``kl_divergence`` (KL(shard || global), epsilon 1e-10).

    Raises
    ------
    ValueError
        On malformed labels, shards or features.
    """
    y = _check_labels(labels)
    checked = _check_shards(shards, y.size)
    classes, global_counts = np.unique(y, return_counts=True)
    global_p = global_counts / y.size
    x: np.ndarray | None = None
    if features is not None:
        x = np.asarray(features)
        if x.ndim < 1 or x.shape[0] != y.size:
            raise ValueError(f"features must have {y.size} rows, got shape {x.shape}")
        x = x.reshape(y.size, -1)
        global_mean, global_var = _feature_moments(x, np.arange(y.size))

    entries: list[dict[str, Any]] = []
    for idx in checked:
        counts = np.array([np.count_nonzero(y[idx] == c) for c in classes], dtype=np.float64)
        p = counts / idx.size if idx.size else np.zeros_like(global_p)
        entry: dict[str, Any] = {
            "size": int(idx.size),
            "class_proportions": [float(v) for v in p],
            "max_abs_deviation": float(np.abs(p - global_p).max()),
            "kl_divergence": _kl_divergence(p, global_p) if idx.size else float("nan"),
        }
        if x is not None and idx.size:
            mean, var = _feature_moments(x, idx)
            entry["feature_mean"] = float(mean.mean())
            entry["feature_var"] = float(var.mean())
            entry["feature_mean_abs_dev"] = float(np.abs(mean - global_mean).mean())
            entry["feature_var_abs_dev"] = float(np.abs(var - global_var).mean())
        entries.append(entry)

    all_indices = np.concatenate(checked)
    sizes = np.array([e["size"] for e in entries], dtype=np.float64)
    summary: dict[str, Any] = {
        "num_shards": len(entries),
        "num_samples": int(y.size),
        "disjoint": bool(np.unique(all_indices).size == all_indices.size),
        "covers_all": bool(np.array_equal(np.unique(all_indices), np.arange(y.size))),
        "size_min": int(sizes.min()),
        "size_max": int(sizes.max()),
        "size_mean": float(sizes.mean()),
    }
    for key in (
        "max_abs_deviation",
        "kl_divergence",
        "feature_mean_abs_dev",
        "feature_var_abs_dev",
    ):
        values = np.array([e[key] for e in entries if key in e], dtype=np.float64)
        if values.size:
            summary[f"{key}_mean"] = float(np.mean(values))
            summary[f"{key}_max"] = float(np.max(values))
    global_entry: dict[str, Any] = {"class_proportions": [float(v) for v in global_p]}
    if x is not None:
        global_entry["feature_mean"] = float(global_mean.mean())
        global_entry["feature_var"] = float(global_var.mean())
    return {
        "classes": [int(c) for c in classes],
        "global": global_entry,
        "shards": entries,
        "summary": summary,
    }
