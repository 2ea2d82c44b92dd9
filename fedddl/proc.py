"""Process helpers shared by the deployment harness and the gossip peer launcher."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["pid_alive"]


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
