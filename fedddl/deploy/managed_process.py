"""Processes the deployment harness starts: logged, own session, stopped with all descendants.

Flower-free: :func:`start_process` runs any command with its output in a log file and its
own session; :class:`ManagedProcess` stops the process, its group and every descendant it
ever saw (by pid, and only while the pid still names the same process);
:class:`ProcessRegistry` and :func:`stopping` stop many, also on error.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedddl.proc import pid_alive

__all__ = [
    "DeploymentError",
    "ManagedProcess",
    "ProcessRegistry",
    "command_line",
    "descendant_pids",
    "spawn_logged",
    "start_process",
    "stopping",
    "tcp_accepts",
    "wait_for_port",
]


class DeploymentError(RuntimeError):
    """A deployment process failed to start, exited early or timed out."""


def descendant_pids(pid: int) -> list[int]:
    """Return all live descendants of ``pid`` (children first), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may hold spaces,
        # so split after its closing parenthesis.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    result: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        for child in children.get(current, []):
            result.append(child)
            frontier.append(child)
    return result


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 overall; counted after the ")" that closes the command name.
    return int(stat[stat.rfind(")") + 2 :].split()[19])


@dataclass
class ManagedProcess:
    """A started Flower process with its log file; stop it with :meth:`stop`."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""
    node_id: int | None = None
    #: Helper processes stopped together with this one (e.g. its warm ClientApp server).
    companions: list[ManagedProcess] = field(default_factory=list)
    #: Directories removed after stopping (e.g. a Unix socket's directory).
    cleanup_dirs: list[Path] = field(default_factory=list)
    # pid -> start time: a pid is only signalled while it is still the same process
    # (pids are reused; never signal someone else's process).
    _known_descendants: dict[int, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.popen.poll() is None

    def log_text(self) -> str:
        """Everything the process wrote so far (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def refresh_descendants(self) -> None:
        """Remember the current descendants, so they can be killed after a reparent."""
        if self.alive():
            for pid in descendant_pids(self.pid):
                started = _start_time(pid)
                if started is not None:
                    self._known_descendants.setdefault(pid, started)

    def _live_descendants(self) -> list[int]:
        return sorted(pid for pid, started in self._known_descendants.items()
                      if _start_time(pid) == started)

    def wait_for_log(self, pattern: str | re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """Wait until the log matches ``pattern``; raise if it exits or times out."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout_s
        while True:
            match = regex.search(self.log_text())
            if match:
                return match
            if not self.alive():
                raise DeploymentError(
                    f"{self.name} exited with code {self.popen.returncode} before its "
                    f"log matched {regex.pattern!r}; log tail:\n{self.log_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"{self.name}: log did not match {regex.pattern!r} within "
                    f"{timeout_s:.0f} s; log tail:\n{self.log_text()[-3000:]}"
                )
            time.sleep(0.1)

    def terminate(self) -> None:
        """Send SIGTERM to the process, its group, its descendants and companions; no wait."""
        self.refresh_descendants()
        # Signal by pid/pgid only while the leader is unreaped: afterwards its pid
        # (and thus the group id) may belong to an unrelated process.
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGTERM)
        for pid in self._live_descendants():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        for companion in self.companions:
            companion.terminate()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the process, its process group and every descendant; idempotent.

        SIGTERM first (Flower shuts down cleanly on it), SIGKILL after
        ``timeout_s`` for whatever is left.
        """
        self.terminate()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None and not any(
                pid_alive(pid) for pid in self._live_descendants()
            ):
                break
            time.sleep(0.05)
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        for pid in self._live_descendants():
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)
        for companion in self.companions:
            companion.stop(timeout_s)
        for directory in self.cleanup_dirs:
            shutil.rmtree(directory, ignore_errors=True)


def command_line(argv: Sequence[str], env: Mapping[str, str], prefix: Sequence[str]) -> list[str]:
    """``prefix + argv`` with ``argv[0]`` resolved on the environment's PATH."""
    executable = shutil.which(argv[0], path=env.get("PATH"))
    if executable is None:
        raise DeploymentError(f"{argv[0]!r} not found on PATH")
    return [*prefix, executable, *argv[1:]]


def spawn_logged(name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str],
           cwd: str | Path | None = None, prefix: Sequence[str] = ()) -> ManagedProcess:
    command = command_line(argv, env, prefix)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        popen = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            cwd=cwd,
            # Own session: the harness can signal the whole group at once.
            start_new_session=True,
        )
    return ManagedProcess(name=name, popen=popen, log_path=log_path)


def start_process(
    name: str, argv: Sequence[str], log_dir: str | Path, *, env: Mapping[str, str],
    cwd: str | Path | None = None, prefix: Sequence[str] = (),
) -> ManagedProcess:
    """Start any command (e.g. a non-blocking ``flwr run``) as a :class:`ManagedProcess`.

    Output goes to ``log_dir/NAME.log``; the process gets its own session so
    :meth:`ManagedProcess.stop` can end its whole tree. ``prefix`` is put in
    front of the command line (e.g. ``["ip", "netns", "exec", NS]``, which
    execs the command in place, so the pid is the command's).
    """
    return spawn_logged(name, argv, Path(log_dir) / f"{name}.log", env, cwd, prefix)


def tcp_accepts(host: str, port: int) -> bool:
    """Whether ``host:port`` accepts a TCP connection from this process right now."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout_s: float,
                  process: ManagedProcess | None = None,
                  probe: Callable[[str, int], bool] = tcp_accepts) -> None:
    """Wait until ``probe(host, port)`` (by default: it accepts TCP connections here).

    Raises :class:`DeploymentError` if ``process`` exits first or ``timeout_s`` passes.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if probe(host, port):
            return
        if process is not None and not process.alive():
            raise DeploymentError(
                f"{process.name} exited with code {process.popen.returncode}; log tail:\n"
                f"{process.log_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise DeploymentError(f"{host}:{port} not accepting connections after {timeout_s} s")
        time.sleep(0.1)


class ProcessRegistry:
    """Remembers started processes and stops them all, newest first."""

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []

    def add(self, process: ManagedProcess) -> ManagedProcess:
        """Track ``process`` and return it."""
        self.processes.append(process)
        return process

    def stop_all(self) -> None:
        """Stop every tracked process (idempotent); all get SIGTERM before any wait."""
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            process.stop()


@contextlib.contextmanager
def stopping(processes: list[ManagedProcess]) -> Iterator[list[ManagedProcess]]:
    """Yield ``processes``; stop every one in it on exit (reverse order), also on error."""
    try:
        yield processes
    finally:
        for process in reversed(processes):
            process.stop()
