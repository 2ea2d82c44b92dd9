"""The chunk scheduler: every element covered once, chunk-aligned, errors re-raised."""

from __future__ import annotations

import threading

import pytest

from fedddl.compression.backends.parallel import run_in_chunks, run_pipelined


@pytest.mark.parametrize("numel", [0, 1, 9, 10, 11, 95])
def test_run_in_chunks_covers_every_element_once_on_chunk_boundaries(
    threads: int, numel: int
) -> None:
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def work(lo: int, hi: int) -> None:
        with lock:
            seen.append((lo, hi))

    run_in_chunks(work, numel, 10)
    covered = sorted(seen)
    assert [i for lo, hi in covered for i in range(lo, hi)] == list(range(numel))
    assert all(lo % 10 == 0 for lo, _ in covered)
    assert len(covered) <= max(threads, 1)


def test_pipelined_prepares_each_segment_before_its_work_and_bounds_concurrency(
    threads: int,
) -> None:
    prepared: set[int] = set()
    active, peak = 0, 0
    lock = threading.Lock()
    done: list[int] = []

    def prepare(lo: int, hi: int) -> None:
        assert threading.current_thread() is threading.main_thread()
        prepared.add(lo)

    def work(lo: int, hi: int) -> None:
        nonlocal active, peak
        with lock:
            assert lo in prepared
            active += 1
            peak = max(peak, active)
        threading.Event().wait(0.002)
        with lock:
            active -= 1
            done.extend(range(lo, hi))

    run_pipelined(prepare, work, 103, 10)
    assert sorted(done) == list(range(103))
    assert prepared == set(range(0, 103, 10))
    assert peak <= threads


@pytest.mark.parametrize("runner", ["chunks", "pipelined"])
def test_an_error_in_any_range_is_raised_after_the_others_finish(
    threads: int, runner: str
) -> None:
    finished: list[int] = []
    lock = threading.Lock()

    def work(lo: int, hi: int) -> None:
        if lo <= 20 < hi:
            raise RuntimeError("the range holding 20 failed")
        with lock:
            finished.append(lo)

    with pytest.raises(RuntimeError, match="holding 20 failed"):
        if runner == "chunks":
            run_in_chunks(work, 40, 10)
        else:
            run_pipelined(lambda lo, hi: None, work, 40, 10)
    if threads == 1:  # all on the calling thread: the error stops the loop
        assert sorted(finished) == ([] if runner == "chunks" else [0, 10])
    elif runner == "pipelined":  # one segment per chunk: the others finished
        assert sorted(finished) == [0, 10, 30]
    else:  # 4 chunks on 2 or 3 threads: two ranges, 0..20 and 20..40
        assert finished == [0]
