"""Process helpers shared by the deployment harness, the gossip peer launcher and
``fedddl run``."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

__all__ = ["pid_alive", "pids_with_env", "stop_pids"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie.

    A zombie still answers signal 0, so its ``/proc/<pid>/stat`` state is read too.
    Without procfs, the answer of ``kill(pid, 0)`` is trusted.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False  # exited between the two checks
    except OSError:
        return True  # no procfs: trust kill()
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def pids_with_env(key: str, value: str) -> list[int]:
    """Live processes (other than this one) whose environment holds ``key=value``.

    Every process inherits its parent's environment, also when it detaches into a new
    session, so a unique value set before starting something finds exactly what was
    started from it, by process id. Only processes whose ``/proc/<pid>/environ`` this
    user may read are seen; without procfs the list is empty.
    """
    needle = f"{key}={value}".encode()
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def stop_pids(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """SIGTERM each of ``pids``, SIGKILL what is left after ``timeout_s``.

    Returns the pids that had to be killed.
    """
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    killed = [p for p in pids if pid_alive(p)]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return killed
