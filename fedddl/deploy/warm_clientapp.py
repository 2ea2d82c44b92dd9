"""Warm ``flwr-clientapp`` starts: fork ClientApp processes from a pre-imported server.

Flower's isolation is unchanged (one process per message, state only via
``context.state``); only the start is cheap. ``python -m fedddl.deploy.warm_clientapp
serve --socket S --preload torch`` runs a single-threaded fork server that imports flwr's
ClientApp runtime and the listed modules once (they must not start threads at import);
:func:`install_shim` writes a stdlib-only ``flwr-clientapp`` script that a SuperNode with
that directory first on ``PATH`` and ``FEDDDL_WARM_CLIENTAPP_SOCKET=S`` runs: it hands
argv, environment, cwd and stdio to the server and exits with the forked child's exit
code; the child becomes exactly what ``flwr-clientapp ARGS`` would have been. With the
socket unreachable the shim runs the real ``flwr-clientapp``. Why and what it saves:
docs/deployment.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

__all__ = [
    "DEFAULT_ENTRY",
    "SOCKET_ENV",
    "install_shim",
    "main",
    "preload_modules",
    "serve",
]

SOCKET_ENV = "FEDDDL_WARM_CLIENTAPP_SOCKET"
DEFAULT_ENTRY = "flwr.supernode.cli.flwr_clientapp:flwr_clientapp"
_LENGTH = struct.Struct(">I")
_STATUS = struct.Struct(">i")

# The shim must start fast: no site-packages (-S), stdlib only.
_SHIM_TEMPLATE = '''#!{python} -S
"""flwr-clientapp shim (fedddl.deploy.warm_clientapp): run via the fork server."""
import json, os, socket, struct, sys

REAL = {real!r}
path = os.environ.get({env!r}, "")
try:
    if not path:
        raise OSError("no fork server socket configured")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
except OSError:
    os.execv(REAL, [REAL, *sys.argv[1:]])
request = json.dumps({{"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
socket.send_fds(sock, [struct.pack(">I", len(request)) + request], [0, 1, 2])
status = b""
while len(status) < 4:
    chunk = sock.recv(4 - len(status))
    if not chunk:
        sys.exit(1)
    status += chunk
sys.exit(struct.unpack(">i", status)[0])
'''


def install_shim(shim_dir: str | Path, real_clientapp: str | Path | None = None) -> Path:
    """Write the ``flwr-clientapp`` shim into ``shim_dir`` and return its path.

    Parameters
    ----------
    shim_dir : str or Path
        Directory to put first on the SuperNode's ``PATH``.
    real_clientapp : str or Path, optional
        The real ``flwr-clientapp`` (fallback); next to this Python by default.
    """
    default_real = Path(sys.executable).parent / "flwr-clientapp"
    real = Path(real_clientapp) if real_clientapp else default_real
    if not real.exists():
        raise FileNotFoundError(f"real flwr-clientapp not found at {real}")
    directory = Path(shim_dir)
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "flwr-clientapp"
    shim.write_text(
        _SHIM_TEMPLATE.format(python=sys.executable, real=str(real), env=SOCKET_ENV),
        encoding="utf-8",
    )
    shim.chmod(0o755)
    return shim


def _receive_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < _LENGTH.size:
        raise ValueError("short request")
    (length,) = _LENGTH.unpack_from(data)
    body = bytearray(data[_LENGTH.size:])
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            raise ValueError("request cut short")
        body += chunk
    return json.loads(bytes(body)), list(fds)


def _load_entry(entry: str) -> Callable[[], object]:
    module_name, _, attr = entry.partition(":")
    function = getattr(importlib.import_module(module_name), attr)
    if not callable(function):
        raise TypeError(f"{entry} is not callable")
    return cast(Callable[[], object], function)


def _run_child(request: dict[str, object], fds: list[int], entry: Callable[[], object]) -> int:
    """In the forked child: become ``flwr-clientapp ARGV`` and run it."""
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    os.chdir(str(request["cwd"]))
    argv = request["argv"]
    assert isinstance(argv, list)
    sys.argv = ["flwr-clientapp", *[str(a) for a in argv[1:]]]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    try:
        entry()
        return 0
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def preload_modules(entries: Sequence[str]) -> None:
    """Import each ``module``; for ``module:function`` also call ``function()``.

    Raises
    ------
    ImportError, AttributeError
        Naming the module or function that is missing.
    TypeError
        If ``function`` is not callable.
    """
    for entry in entries:
        if ":" in entry:
            _load_entry(entry)()
        else:
            importlib.import_module(entry)


def serve(
    socket_path: str | Path, preload: Sequence[str] = ("torch",), entry: str = DEFAULT_ENTRY
) -> None:
    """Run the fork server on ``socket_path`` until SIGTERM/SIGINT.

    Parameters
    ----------
    socket_path : str or Path
        Unix socket to listen on (replaced if it exists).
    preload : sequence of str
        Modules to import once before serving (besides ``entry``'s module); an entry
        ``module:function`` also calls that function (no arguments) after the import,
        e.g. ``fedddl.compression.warmup:warm_up`` to compile the compression kernels once
        instead of in every forked child.
    entry : str
        ``module:function`` each forked child runs with the shim's ``sys.argv``;
        Flower's ``flwr-clientapp`` entry point by default.
    """
    entry_function = _load_entry(entry)  # imports Flower's ClientApp runtime once
    preload_modules(preload)

    path = Path(socket_path)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o600)
    listener.listen(64)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> shim connection
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    print(f"warm clientapp server ready on {path} (preloaded: {', '.join(preload)})", flush=True)

    while not stopping:
        for _key, _ in selector.select(timeout=0.05):
            with contextlib.suppress(BlockingIOError):
                conn, _ = listener.accept()
                conn.setblocking(True)
                try:
                    request, fds = _receive_request(conn)
                except (OSError, ValueError) as err:
                    print(f"bad request: {err}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # child
                    listener.close()
                    conn.close()
                    code = _run_child(request, fds, entry_function)
                    with contextlib.suppress(Exception):
                        sys.stdout.flush()
                        sys.stderr.flush()
                    os._exit(code)
                for fd in fds:
                    os.close(fd)
                waiting[pid] = conn
        _reap(waiting)
    for conn in waiting.values():
        conn.close()
    listener.close()
    path.unlink(missing_ok=True)


def _reap(waiting: dict[int, socket.socket]) -> None:
    """Collect finished children and tell their shims the exit code."""
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(_STATUS.pack(os.waitstatus_to_exitcode(status)))
            conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedddl.deploy.warm_clientapp serve|install-shim ...``."""
    parser = argparse.ArgumentParser(prog="python -m fedddl.deploy.warm_clientapp")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cmd = sub.add_parser("serve", help="run the fork server")
    serve_cmd.add_argument("--socket", required=True)
    serve_cmd.add_argument("--preload", default="torch",
                           help="comma-separated modules to import up front; "
                           "module:function also calls function()")
    serve_cmd.add_argument("--entry", default=DEFAULT_ENTRY,
                           help="module:function each child runs (default: flwr-clientapp)")
    shim_cmd = sub.add_parser("install-shim", help="write the flwr-clientapp shim")
    shim_cmd.add_argument("directory")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.socket, [m for m in args.preload.split(",") if m], args.entry)
    else:
        print(install_shim(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
