"""Split element-wise work into per-thread ranges of whole, fixed-size chunks.

numpy releases the GIL inside each ufunc, so plain Python threads run the
chunked kernels of this package in parallel.  Every GIL hand-over between the
threads costs a wake-up, so the kernels use chunks large enough that one
numpy call does tens of microseconds of work.  Range boundaries are always
multiples of the chunk size, so no result ever depends on the thread count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from fedddl.framing import crc32, crc32_combine

__all__ = [
    "MAX_WORKERS",
    "chunk_units",
    "copy_bytes",
    "copy_pieces",
    "crc32_threaded",
    "run_in_chunks",
    "run_pipelined",
    "run_units",
    "worker_count",
]

#: Upper bound on the threads one call uses (``torch.get_num_threads()`` is the usual bound).
MAX_WORKERS = 8
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="fedddl-comp")
    return _pool


def worker_count(numel: int, chunk: int) -> int:
    """Threads used for ``numel`` elements: ``torch.get_num_threads()``, at most one per chunk."""
    chunks = -(-numel // chunk)
    return max(1, min(torch.get_num_threads(), MAX_WORKERS, chunks))


def run_in_chunks(work: Callable[[int, int], None], numel: int, chunk: int) -> None:
    """Call ``work(lo, hi)`` on per-thread ranges of whole chunks covering ``0..numel``.

    ``lo`` is always a multiple of ``chunk``.  With one range the call runs on
    the calling thread; otherwise on the shared pool, and the first exception
    raised by any range is re-raised after all ranges have finished.
    """
    if numel <= 0:
        return
    chunks = -(-numel // chunk)
    workers = worker_count(numel, chunk)
    per = -(-chunks // workers) * chunk
    _run_groups(work, [(lo, min(lo + per, numel)) for lo in range(0, numel, per)])


def _run_groups(work: Callable[[int, int], None], groups: Sequence[tuple[int, int]]) -> None:
    """``work(*group)`` for every group: inline if there is one, else one per pool thread."""
    if len(groups) == 1:
        work(*groups[0])
        return
    _raise_first([_executor().submit(work, lo, hi) for lo, hi in groups])


def _raise_first(futures: Sequence[Future[Any]]) -> None:
    """Wait for all ``futures``, then re-raise the first exception among them, if any."""
    errors = [future.exception() for future in futures]
    for error in errors:
        if error is not None:
            raise error


def chunk_units(sizes: Sequence[int], chunk: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The chunks ``(array index, start)`` of arrays of ``sizes``, and their lengths.

    Starts are multiples of ``chunk`` within each array; empty arrays have none.
    """
    units = [(k, start) for k, size in enumerate(sizes) for start in range(0, size, chunk)]
    return units, [min(chunk, sizes[k] - start) for k, start in units]


def run_units(work: Callable[[int, int], None], weights: Sequence[int], min_weight: int) -> None:
    """Call ``work(first, stop)`` on contiguous groups of units of about equal weight.

    Units ``0 .. len(weights)`` (e.g. the chunks of many tensors, weighted by
    their elements) are cut into one group per thread, at most one thread
    per ``min_weight`` of total weight, so that small units do not each pay
    for a thread hand-over.  Errors are re-raised as in :func:`run_in_chunks`.
    """
    count, total = len(weights), sum(weights)
    if count == 0:
        return
    workers = max(1, min(torch.get_num_threads(), MAX_WORKERS, count, -(-total // min_weight)))
    groups: list[tuple[int, int]] = []
    first, done = 0, 0
    for index, weight in enumerate(weights):
        done += weight
        if len(groups) < workers - 1 and done * workers >= total * (len(groups) + 1):
            groups.append((first, index + 1))
            first = index + 1
    if first < count:
        groups.append((first, count))
    _run_groups(work, groups)


def run_pipelined(
    prepare: Callable[[int, int], None],
    work: Callable[[int, int], None],
    numel: int,
    segment: int,
) -> None:
    """For each segment ``lo..hi`` of ``0..numel``: ``prepare(lo, hi)`` on the calling
    thread, then ``work(lo, hi)`` on the pool, so the serial step of one segment
    overlaps the parallel work of the ones before it.

    With one thread (``torch.get_num_threads() == 1``) both run on the calling
    thread.  The first exception of any ``work`` is re-raised once all have finished.
    """
    workers = worker_count(numel, segment)
    futures: list[Future[None]] = []
    for lo in range(0, numel, segment):
        hi = min(lo + segment, numel)
        prepare(lo, hi)
        if workers == 1:
            work(lo, hi)
            continue
        if len(futures) >= workers:  # at most ``workers`` segments in flight
            futures[len(futures) - workers].exception()
        futures.append(_executor().submit(work, lo, hi))
    _raise_first(futures)


_COPY_CHUNK = 1 << 22  # bytes per chunk of copy_pieces: 4 MiB


def copy_bytes(target: np.ndarray[Any, Any], source: np.ndarray[Any, Any]) -> None:
    """``np.copyto(target, source)`` of equal-size 1-D byte arrays, on up to
    ``torch.get_num_threads()`` threads for large ones (a single thread does not
    reach the machine's memory bandwidth)."""
    if target.shape != source.shape:
        raise ValueError(f"copy_bytes: {target.shape} bytes into {source.shape}")
    copy_pieces([target], [source])


def copy_pieces(
    targets: Sequence[np.ndarray[Any, Any]], sources: Sequence[np.ndarray[Any, Any]]
) -> None:
    """``np.copyto(targets[k], sources[k])`` for every ``k`` (1-D byte arrays of equal
    sizes), in chunks of up to 4 MiB shared out over the threads, so that a model's many
    small tensors are copied in parallel too."""
    units, weights = chunk_units([source.size for source in sources], _COPY_CHUNK)

    def work(first: int, stop: int) -> None:
        for k, start in units[first:stop]:
            end = start + _COPY_CHUNK
            np.copyto(targets[k][start:end], sources[k][start:end])

    run_units(work, weights, 1 << 20)


_CRC_SEGMENT = 1 << 22  # bytes per thread at least, for crc32_threaded


def crc32_threaded(data: bytes | bytearray | memoryview) -> int:
    """``zlib.crc32(data)``, the segments of a large buffer checksummed on up to
    ``torch.get_num_threads()`` threads and combined (:func:`fedddl.framing.crc32_combine`)."""
    view = memoryview(data).cast("B")
    workers = worker_count(view.nbytes, _CRC_SEGMENT)
    if workers == 1:
        return crc32(view)
    per = -(-view.nbytes // workers)
    bounds = [(lo, min(lo + per, view.nbytes)) for lo in range(0, view.nbytes, per)]
    futures = [_executor().submit(crc32, view[lo:hi]) for lo, hi in bounds]
    _raise_first(futures)
    total = 0
    for (lo, hi), future in zip(bounds, futures, strict=True):
        total = crc32_combine(total, future.result(), hi - lo)
    return total
