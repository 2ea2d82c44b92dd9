"""Start and stop real Flower SuperLink / SuperNode processes (loopback or LAN).

The harness used by the end-to-end tests and the latency benchmark. It

* picks free ports at runtime (never fixed ones that could collide);
* starts every process in its own session (process group) with its output in
  a log file, and waits until it is ready (SuperLink: its port accepts TCP
  connections; SuperNode: it logged its node id, i.e. it was admitted);
* stops a process *and all its descendants*: Flower starts ``flower-superexec``
  (SuperLink: detached, in a new session) and ``flwr-serverapp`` /
  ``flwr-clientapp`` children, which a plain ``kill`` of the group would miss.

Flower 1.42 facts this relies on (read from its source): the SuperLink serves
Fleet, Control and Runtime APIs on one HTTP port (``--host``/``--port``); a
SuperNode serves its Runtime API on its own ``--port``; the SuperExec's task
polling interval is read from ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedddl.deploy.certs import TlsPaths
from fedddl.proc import pid_alive

__all__ = [
    "FAST_SUPEREXEC_POLL_INTERVAL_S",
    "FAST_SUPERNODE_POLL_INTERVAL_S",
    "WARM_CLIENTAPP_PRELOAD",
    "DeploymentError",
    "ManagedProcess",
    "ProcessRegistry",
    "descendant_pids",
    "flower_env",
    "format_node_config",
    "free_ports",
    "register_supernode",
    "run_flwr",
    "start_process",
    "start_superlink",
    "start_supernode",
    "start_warm_clientapp_server",
    "stopping",
    "tcp_accepts",
    "wait_for_port",
    "write_flwr_config",
]

#: SuperExec task poll interval the harness uses (Flower's default is 1.0 s).
FAST_SUPEREXEC_POLL_INTERVAL_S = 0.1
#: SuperNode idle message poll the harness uses (Flower's hard-coded value is 3 s).
FAST_SUPERNODE_POLL_INTERVAL_S = 0.2
#: Modules the warm ClientApp fork server imports up front by default.
WARM_CLIENTAPP_PRELOAD: tuple[str, ...] = ("torch", "fedddl.compression.warmup:warm_up")

_SUPERNODE_READY = re.compile(r"SuperNode ID: (\d+)")


class DeploymentError(RuntimeError):
    """A deployment process failed to start, exited early or timed out."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``count`` distinct TCP ports that are free on ``host`` right now.

    All sockets are held open until every port is chosen, so the ports are
    distinct; a tiny race with other programs remains, as with any free port.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def flower_env(
    flwr_home: str | Path | None = None,
    *,
    superexec_poll_interval_s: float | None = FAST_SUPEREXEC_POLL_INTERVAL_S,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Return an environment for Flower processes: offline, quiet, isolated.

    Parameters
    ----------
    flwr_home : str or Path, optional
        Used as ``FLWR_HOME`` (Flower's config.toml, installed FABs, credentials).
    superexec_poll_interval_s : float, optional
        ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``; ``None`` keeps Flower's 1 s default.
    extra : mapping, optional
        More variables, applied last.
    """
    env = dict(os.environ)
    env.update(
        {
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    # The venv's bin holds flower-superexec / flwr-clientapp, which Flower
    # starts by bare name: make sure it is found even if PATH lacks it.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    if superexec_poll_interval_s is None:
        env.pop("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", None)
    else:
        env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = repr(float(superexec_poll_interval_s))
    if extra:
        env.update(extra)
    return env


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


def _command(argv: Sequence[str], env: Mapping[str, str], prefix: Sequence[str]) -> list[str]:
    """``prefix + argv`` with ``argv[0]`` resolved on the environment's PATH."""
    executable = shutil.which(argv[0], path=env.get("PATH"))
    if executable is None:
        raise DeploymentError(f"{argv[0]!r} not found on PATH")
    return [*prefix, executable, *argv[1:]]


def _spawn(name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str],
           cwd: str | Path | None = None, prefix: Sequence[str] = ()) -> ManagedProcess:
    command = _command(argv, env, prefix)
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
    return _spawn(name, argv, Path(log_dir) / f"{name}.log", env, cwd, prefix)


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


def start_superlink(
    log_dir: str | Path,
    *,
    env: Mapping[str, str],
    tls: TlsPaths | None = None,
    enable_supernode_auth: bool = False,
    host: str = "127.0.0.1",
    port: int | None = None,
    database: str | Path | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 60.0,
    prefix: Sequence[str] = (),
    probe: Callable[[str, int], bool] = tcp_accepts,
) -> ManagedProcess:
    """Start ``flower-superlink`` and wait until its port accepts connections.

    Parameters
    ----------
    log_dir : str or Path
        Its log goes to ``log_dir/superlink.log``.
    env : mapping
        Process environment, normally from :func:`flower_env`.
    tls : TlsPaths, optional
        Serve with TLS; without it the SuperLink runs ``--insecure``.
    enable_supernode_auth : bool
        Admit only SuperNodes whose public key was registered
        (``flwr supernode register``); requires ``tls``.
    host, port : str, int
        Where the single HTTP port (Fleet + Control + Runtime APIs) listens;
        a free port is picked when ``port`` is None.
    database : str or Path, optional
        ``--database`` (LinkState file); in memory when omitted.
    extra_args : sequence of str
        Appended verbatim.
    timeout_s : float
        How long to wait for readiness.
    prefix : sequence of str
        Command prefix (e.g. to run it in another network namespace).
    probe : callable
        ``probe(host, port) -> bool``: readiness check (default: a TCP connect from
        here; a SuperLink in another network namespace needs one made there).

    Returns
    -------
    ManagedProcess
        With ``address`` set to ``host:port``.
    """
    if enable_supernode_auth and tls is None:
        raise ValueError("SuperNode authentication requires TLS (pass tls=...)")
    port = port if port is not None else free_ports(1, host)[0]
    argv = ["flower-superlink", "--host", host, "--port", str(port)]
    argv += tls.superlink_args() if tls is not None else ["--insecure"]
    if enable_supernode_auth:
        argv.append("--enable-supernode-auth")
    if database is not None:
        argv += ["--database", str(database)]
    argv += list(extra_args)
    process = _spawn("superlink", argv, Path(log_dir) / "superlink.log", env, prefix=prefix)
    process.address = f"{host}:{port}"
    try:
        wait_for_port(host, port, timeout_s, process, probe)
        process.refresh_descendants()
    except BaseException:
        process.stop()
        raise
    return process


def start_supernode(
    name: str,
    superlink_address: str,
    log_dir: str | Path,
    *,
    env: Mapping[str, str],
    root_certificate: Path | None = None,
    auth_private_key: Path | None = None,
    node_config: Mapping[str, str | int | float] | None = None,
    runtime_port: int | None = None,
    extra_args: Sequence[str] = (),
    poll_interval_s: float | None = FAST_SUPERNODE_POLL_INTERVAL_S,
    warm_clientapp_preload: Sequence[str] | None = WARM_CLIENTAPP_PRELOAD,
    wait_ready: bool = True,
    timeout_s: float = 60.0,
    prefix: Sequence[str] = (),
) -> ManagedProcess:
    """Start ``flower-supernode``; by default wait until the SuperLink admitted it.

    Parameters
    ----------
    name : str
        Label; its log goes to ``log_dir/NAME.log``.
    superlink_address : str
        ``host:port`` of the SuperLink.
    log_dir : str or Path
        Directory for the log.
    env : mapping
        Process environment, normally from :func:`flower_env`.
    root_certificate : Path, optional
        CA certificate that signed the SuperLink's certificate (TLS); without it
        the SuperNode connects ``--insecure``.
    auth_private_key : Path, optional
        The SuperNode's private key (``--auth-supernode-private-key``).
    node_config : mapping, optional
        ``--node-config`` entries, e.g. ``{"partition-id": 0, "num-partitions": 3}``;
        strings are quoted as Flower's parser requires.
    runtime_port : int, optional
        Port of the SuperNode's own Runtime API; free port when omitted.
    extra_args : sequence of str
        Appended verbatim.
    poll_interval_s : float, optional
        Run through :mod:`fedddl.flower.fast_supernode` with this idle poll
        interval instead of Flower's hard-coded 3 s (default 0.2 s); plain
        ``flower-supernode`` when None.
    warm_clientapp_preload : sequence of str, optional
        Start a :mod:`fedddl.deploy.warm_clientapp` fork server preloading
        these modules (e.g. ``["torch"]``) and make this SuperNode's
        ClientApp processes fork from it; stopped with the SuperNode. Default:
        ``("torch",)``; None runs stock ``flwr-clientapp`` processes.
    wait_ready : bool
        Wait for the ``SuperNode ID:`` log line (sets ``node_id``).
    timeout_s : float
        How long to wait for it (and for the warm ClientApp server to be ready).
    prefix : sequence of str
        Command prefix of the SuperNode and its warm ClientApp server (e.g. to run
        both in one network namespace: the ClientApps reach the SuperNode on loopback).
    """
    runtime_port = runtime_port if runtime_port is not None else free_ports(1)[0]
    argv = ["flower-supernode", "--superlink", superlink_address,
            "--host", "127.0.0.1", "--port", str(runtime_port)]
    argv += ["--root-certificates", str(root_certificate)] if root_certificate else ["--insecure"]
    if auth_private_key is not None:
        argv += ["--auth-supernode-private-key", str(auth_private_key)]
    if node_config:
        argv += ["--node-config", format_node_config(node_config)]
    argv += list(extra_args)
    if poll_interval_s is not None:
        argv = [sys.executable, "-m", "fedddl.flower.fast_supernode",
                "--poll-interval", repr(float(poll_interval_s)), "--", *argv[1:]]
    warm_server: ManagedProcess | None = None
    if warm_clientapp_preload is not None:
        warm_server, warm_env = start_warm_clientapp_server(
            f"{name}-warm-clientapp", log_dir, env=env, preload=warm_clientapp_preload,
            prefix=prefix, timeout_s=timeout_s,
        )
        env = {**env, **warm_env}
    process = _spawn(name, argv, Path(log_dir) / f"{name}.log", env, prefix=prefix)
    process.address = f"127.0.0.1:{runtime_port}"
    if warm_server is not None:
        process.companions.append(warm_server)
    if wait_ready:
        try:
            match = process.wait_for_log(_SUPERNODE_READY, timeout_s)
            process.node_id = int(match.group(1))
            process.refresh_descendants()
        except BaseException:
            process.stop()
            raise
    return process


def start_warm_clientapp_server(
    name: str,
    log_dir: str | Path,
    *,
    env: Mapping[str, str],
    preload: Sequence[str] = ("torch",),
    timeout_s: float = 60.0,
    prefix: Sequence[str] = (),
) -> tuple[ManagedProcess, dict[str, str]]:
    """Start a warm ClientApp fork server; return it and the env a SuperNode needs.

    The returned variables put the ``flwr-clientapp`` shim first on ``PATH``
    and point it at the server's socket (see :mod:`fedddl.deploy.warm_clientapp`).
    """
    from fedddl.deploy.warm_clientapp import SOCKET_ENV, install_shim

    # AF_UNIX paths are limited to ~108 bytes: keep the socket under /tmp.
    runtime_dir = Path(tempfile.mkdtemp(prefix="fedddl-warm-"))
    socket_path = runtime_dir / "clientapp.sock"
    shim_dir = runtime_dir / "bin"
    install_shim(shim_dir)
    argv = [sys.executable, "-m", "fedddl.deploy.warm_clientapp", "serve",
            "--socket", str(socket_path), "--preload", ",".join(preload)]
    server = _spawn(name, argv, Path(log_dir) / f"{name}.log", env, prefix=prefix)
    server.cleanup_dirs.append(runtime_dir)
    try:
        server.wait_for_log("warm clientapp server ready", timeout_s)
    except BaseException:
        server.stop()
        raise
    extra = {"PATH": f"{shim_dir}{os.pathsep}{env.get('PATH', '')}", SOCKET_ENV: str(socket_path)}
    return server, extra


def format_node_config(node_config: Mapping[str, str | int | float]) -> str:
    """Render ``--node-config``: space-separated ``key=value``, strings in quotes."""
    parts = []
    for key, value in node_config.items():
        if isinstance(value, str):
            escaped = value.replace("\\", "\\\\").replace('"', '\\"')
            parts.append(f'{key}="{escaped}"')
        elif isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def write_flwr_config(
    flwr_home: str | Path,
    connections: Mapping[str, str],
    *,
    root_certificate: Path | None = None,
    default: str | None = None,
) -> Path:
    """Write ``FLWR_HOME/config.toml`` naming SuperLink connections for ``flwr``.

    Parameters
    ----------
    flwr_home : str or Path
        The ``FLWR_HOME`` directory (created if missing).
    connections : mapping
        Connection name -> SuperLink ``host:port``.
    root_certificate : Path, optional
        CA certificate for TLS connections; without it they are ``insecure``.
    default : str, optional
        Default connection; the first one when omitted.
    """
    if not connections:
        raise ValueError("connections must name at least one SuperLink")
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{default or next(iter(connections))}"', ""]
    for name, address in connections.items():
        lines += [f"[superlink.{name}]", f'address = "{address}"']
        if root_certificate is not None:
            lines.append(f'root-certificates = "{root_certificate}"')
        else:
            lines.append("insecure = true")
        lines.append("")
    path = home / "config.toml"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def run_flwr(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | Path | None = None,
    timeout_s: float = 300.0,
    prefix: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run the ``flwr`` CLI (after ``prefix``) in its own process group; kill it all on timeout."""
    popen = subprocess.Popen(
        _command(["flwr", *args], env, prefix), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, env=dict(env), cwd=cwd, text=True, start_new_session=True,
    )
    try:
        out, _ = popen.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        out, _ = popen.communicate()
        raise DeploymentError(f"flwr {' '.join(args)} timed out after {timeout_s} s:\n{out}") \
            from err
    return subprocess.CompletedProcess(popen.args, popen.returncode, out, "")


def register_supernode(
    public_key: Path, connection: str, *, env: Mapping[str, str], timeout_s: float = 60.0,
    prefix: Sequence[str] = (),
) -> int:
    """Register a SuperNode public key with ``flwr supernode register``; return its node id."""
    result = run_flwr(["supernode", "register", str(public_key), connection, "--format", "json"],
                      env=env, timeout_s=timeout_s, prefix=prefix)
    match = re.search(r'"node-id":\s*(\d+)', result.stdout)
    if result.returncode != 0 or match is None:
        raise DeploymentError(
            f"flwr supernode register failed (exit {result.returncode}):\n{result.stdout}"
        )
    return int(match.group(1))


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
