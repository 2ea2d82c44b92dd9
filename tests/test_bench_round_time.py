"""The interleaved mode of ``simulations/bench_round_time.py``: which rounds count, how
cycles pair, and that pausing a run stops every process it started (Ray's are its
grandchildren)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from fedddl.proc import pid_alive
from simulations import bench_round_time


def test_a_round_counts_only_inside_one_slice_of_its_run() -> None:
    bench = bench_round_time
    slices = [bench.Slice(10.0, 13.0), bench.Slice(20.0, 23.0)]
    ends = [10.5, 11.0, 12.9, 13.2, 21.0, 22.5, 23.5, None]
    walls = [0.1, 0.5, 0.4, 0.1, 0.5, 2.5, 0.2, 0.1]
    # 10.5 started at 10.4 (after the resume at 10.0): in; 11.0 started at 10.5: in;
    # 12.9 started at 12.5: in; 13.2 ended after the pause; 21.0 in the second slice;
    # 22.5 started at 20.0, not after the resume; 23.5 after the pause; None: no end time
    assert bench.rounds_in_slices(ends, walls, slices) == [[0, 1, 2], [4]]


def test_cycles_pair_the_k_th_slices_and_skip_empty_ones() -> None:
    bench = bench_round_time
    terngrad = [[1.0, 3.0], [2.0], [], [4.0]]
    fedavg = [[2.0], [2.0, 2.0, 4.0], [1.0]]
    assert bench.cycle_ratios(terngrad, fedavg) == [1.0, 1.0]


def test_interleave_must_be_a_positive_number_of_seconds() -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_round_time.main(["--interleave", "-1"])
    assert exit_info.value.code == 2


def _states(*pids: int) -> set[str]:
    return {Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] for p in pids}


def _settled(pids: tuple[int, ...], stopped: bool) -> set[str]:
    """The processes' states once they are all stopped (or all not), or after 10 s
    (a signal is delivered asynchronously)."""
    def done(states: set[str]) -> bool:
        return states == {"T"} if stopped else "T" not in states

    deadline = time.monotonic() + 10
    while not done(_states(*pids)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _states(*pids)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs procfs")
def test_pause_stops_the_whole_run_and_resume_continues_it(tmp_path: Path) -> None:
    bench = bench_round_time
    loop = "import time\\nwhile True: time.sleep(0.01)"
    spawn = (
        "import subprocess, sys, time; "
        f"g = subprocess.Popen([sys.executable, '-c', '{loop}']); "
        "print(g.pid, flush=True); time.sleep(120)"
    )
    child = bench._Child([sys.executable, "-c", spawn], "probe", tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not child.out.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int(child.out.read_text().split()[0])
        assert sorted(child.pids()) == sorted([child.process.pid, grandchild])
        both = (child.process.pid, grandchild)
        child.pause()
        assert _settled(both, stopped=True) == {"T"}
        time.sleep(0.2)
        assert _states(*both) == {"T"}  # stays stopped
        child.resume()
        assert "T" not in _settled(both, stopped=False)
    finally:
        child.resume()
        for pid in child.pids():
            bench.os.kill(pid, bench.signal.SIGKILL)
        child.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(grandchild)
