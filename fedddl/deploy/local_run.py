"""``flwr run APP local --stream`` on a private local SuperLink, stopped when the run ends.

Flower 1.42's ``flwr run . local`` starts a *detached* ``flower-superlink`` (simulation
mode, with its ``flower-superexec`` and ``flwr-simulation`` children) on the fixed port
``$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` (39091) when none answers there, keeps no pid of
it, and leaves it running after the run; Flower has no command that stops it (``flwr
stop`` stops a run, not the SuperLink). :func:`run_local` instead

1. starts that same SuperLink itself (the arguments ``flwr`` uses: ``--simulation
   --isolation subprocess``, in-memory state) on free ports, in its own session, with a
   unique ``FEDDDL_RUN_TOKEN`` in its environment;
2. runs ``flwr run APP local --stream ...`` with ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` /
   ``FLWR_LOCAL_CONTROL_API_PORT`` pointing at it, so ``flwr`` finds it running and starts
   none of its own (a SuperLink the user runs on the default port is not touched);
3. when the run ends (also on error or Ctrl-C), stops the SuperLink, its process group
   and descendants, then every process still carrying the token -- by process id.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedddl.deploy.processes import flower_env, free_ports, start_superlink
from fedddl.proc import pids_with_env, stop_pids

__all__ = ["TOKEN_ENV", "LocalRun", "run_local"]

#: Environment variable whose unique value marks every process one run started.
TOKEN_ENV = "FEDDDL_RUN_TOKEN"


@dataclass
class LocalRun:
    """What :func:`run_local` did."""

    returncode: int
    superlink_pid: int
    token: str
    stopped: list[int] = field(default_factory=list)
    left_running: list[int] = field(default_factory=list)


def _flwr() -> str:
    beside = Path(sys.executable).with_name("flwr")
    found = shutil.which("flwr")
    if beside.exists():
        return str(beside)
    if found is None:
        raise FileNotFoundError("the 'flwr' command (Flower) is not installed")
    return found


def run_local(
    app: str | Path = ".",
    flwr_args: Sequence[str] = (),
    *,
    startup_timeout_s: float = 60.0,
    say: Callable[[str], None] = print,
) -> LocalRun:
    """Run ``flwr run APP local --stream FLWR_ARGS`` and stop everything it started.

    Parameters
    ----------
    app : str or Path
        The Flower app directory (holds ``pyproject.toml``).
    flwr_args : sequence of str
        More ``flwr run`` arguments (``--federation-config``, ``--run-config``, ...).
    startup_timeout_s : float
        Seconds to wait for the SuperLink to accept connections.
    say : Callable[[str], None]
        Where the few lines of this function go (``flwr``'s own output is not captured).

    Returns
    -------
    LocalRun
        ``flwr run``'s exit code, the SuperLink's pid, the pids stopped at the end and
        any process that could not be stopped (empty when all went well).
    """
    token = uuid.uuid4().hex
    http_port, control_port = free_ports(2)
    env = flower_env(
        extra={
            TOKEN_ENV: token,
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
            "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
        }
    )
    log_dir = Path(tempfile.mkdtemp(prefix="fedddl-run-"))
    superlink = start_superlink(
        log_dir,
        env=env,
        port=http_port,
        extra_args=[
            "--simulation",
            "--isolation",
            "subprocess",
            "--control-api-address",
            f"127.0.0.1:{control_port}",
        ],
        timeout_s=startup_timeout_s,
    )
    say(f"fedddl run: local SuperLink pid {superlink.pid} on 127.0.0.1:{http_port}")
    result = LocalRun(returncode=1, superlink_pid=superlink.pid, token=token)
    try:
        command = [_flwr(), "run", str(app), "local", "--stream", *flwr_args]
        result.returncode = subprocess.run(command, env=env, check=False).returncode
    finally:
        superlink.stop()
        leftovers = pids_with_env(TOKEN_ENV, token)
        killed = stop_pids(leftovers) if leftovers else []
        result.stopped = sorted({superlink.pid, *leftovers})
        result.left_running = [p for p in pids_with_env(TOKEN_ENV, token) if p not in killed]
        if result.returncode != 0:
            tail = superlink.log_text()[-2000:]
            if tail:
                say(f"fedddl run: SuperLink log tail:\n{tail}")
        shutil.rmtree(log_dir, ignore_errors=True)
        say(
            f"fedddl run: stopped the local SuperLink (pid {superlink.pid}) and everything "
            "it started; nothing of this run is left running"
            if not result.left_running
            else f"fedddl run: could not stop pids {result.left_running}"
        )
    return result
