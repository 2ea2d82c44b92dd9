"""Start and stop real Flower SuperLink / SuperNode processes (loopback or LAN).

The harness used by the end-to-end tests and the latency benchmark, on top of
:mod:`fedddl.deploy.managed_process` (logged processes in their own session, stopped with
every descendant; re-exported here). It picks free ports at runtime (never fixed ones that
could collide), gives Flower an offline, quiet, isolated environment, and waits until each
process is ready (SuperLink: its port accepts TCP connections; SuperNode: it logged its
node id, i.e. it was admitted). Stopping matters because Flower starts
``flower-superexec`` (SuperLink: detached, in a new session) and ``flwr-serverapp`` /
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
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from fedddl.deploy.certs import TlsPaths
from fedddl.deploy.managed_process import (
    DeploymentError,
    ManagedProcess,
    ProcessRegistry,
    command_line,
    descendant_pids,
    spawn_logged,
    start_process,
    stopping,
    tcp_accepts,
    wait_for_port,
)

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
#: Modules the warm ClientApp fork server imports up front by default (the last entry
#: shortens the ClientApp's retry waits for message objects still arriving:
#: :mod:`fedddl.flower.object_pull`).
WARM_CLIENTAPP_PRELOAD: tuple[str, ...] = ("torch", "fedddl.compression.warmup:warm_up",
                                           "fedddl.flower.object_pull:patch_clientapp_pulls")

_SUPERNODE_READY = re.compile(r"SuperNode ID: (\d+)")


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
    heartbeat_patience: int | None = None,
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
    heartbeat_patience : int, optional
        Missed heartbeats before a task or node counts as gone (Flower: 2), through
        :mod:`fedddl.flower.heartbeat_patience`.

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
    if heartbeat_patience is not None:
        argv = [sys.executable, "-m", "fedddl.flower.heartbeat_patience",
                "--patience", str(int(heartbeat_patience)), "--", *argv[1:]]
    process = spawn_logged("superlink", argv, Path(log_dir) / "superlink.log", env, prefix=prefix)
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
    heartbeat_patience: int | None = None,
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
    heartbeat_patience : int, optional
        Missed heartbeats before a ClientApp counts as stopped (Flower: 2); needs the
        fast SuperNode launcher (``poll_interval_s`` set).
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
    if heartbeat_patience is not None and poll_interval_s is None:
        raise ValueError("heartbeat_patience needs the fast SuperNode launcher (poll_interval_s)")
    if poll_interval_s is not None:
        patience = ([] if heartbeat_patience is None
                    else ["--heartbeat-patience", str(int(heartbeat_patience))])
        argv = [sys.executable, "-m", "fedddl.flower.fast_supernode",
                "--poll-interval", repr(float(poll_interval_s)), *patience, "--", *argv[1:]]
    warm_server: ManagedProcess | None = None
    if warm_clientapp_preload is not None:
        warm_server, warm_env = start_warm_clientapp_server(
            f"{name}-warm-clientapp", log_dir, env=env, preload=warm_clientapp_preload,
            prefix=prefix, timeout_s=timeout_s,
        )
        env = {**env, **warm_env}
    process = spawn_logged(name, argv, Path(log_dir) / f"{name}.log", env, prefix=prefix)
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
    server = spawn_logged(name, argv, Path(log_dir) / f"{name}.log", env, prefix=prefix)
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
        command_line(["flwr", *args], env, prefix),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
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
