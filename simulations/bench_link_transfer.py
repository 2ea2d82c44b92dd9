"""Time real transfers over the testbed's shaped links: raw TCP and gRPC, against bytes / rate.

Run as root from the repository root::

    python -m simulations.bench_link_transfer --rates-mbit 10,100 --sizes-mb 0.3,1,3,10 \\
        --out results/bench-link-transfer.json

Two namespaces (:class:`fedddl.testbed.netns.Testbed`): node 0 the *client*, its access
link shaped to the rate both ways (``htb``, as ``fedddl testbed`` shapes a SuperNode), and
node 1 the *server*, unshaped (as the SuperLink). A server process in node 1 receives; a
client process in node 0 sends ``N`` bytes per message and waits for a one-byte (TCP) or
empty (gRPC) reply. Modes:

* ``tcp``: one connection, messages back to back;
* ``tcp-idle``: the same with ``--idle-s`` seconds of idle before each message
  (``net.ipv4.tcp_slow_start_after_idle`` as the namespace has it: 1, the kernel default);
* ``tcp-idle-ssai0``: ``tcp-idle`` with ``tcp_slow_start_after_idle=0`` in both namespaces;
* ``grpc``: one unary gRPC call per message on one channel (grpcio's defaults, as Flower);
* ``grpc-idle``: ``grpc`` with the idle gap;
* ``grpc-objects``: the message split into ``--objects`` unary calls, two at a time (the way
  Flower 1.42 pushes a message's objects);
* ``grpc-tuned``: ``grpc`` with a 16 MiB HTTP/2 stream window (``grpc.http2.lookahead_bytes``).

Per cell it records every message's seconds, ``bytes / rate``, their ratio, the TCP
segments both namespaces retransmitted and the ``tc`` drops / overlimits on the client's
two shaped interfaces. No TLS (its cost is CPU, not the link). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedddl.testbed.netns import LinkRates, Testbed, check_support

MODES = ("tcp", "tcp-idle", "tcp-idle-ssai0", "grpc", "grpc-idle", "grpc-objects", "grpc-tuned")
_TCP_PORT = 9300
_GRPC_PORT = 9301
_METHOD = "/bench.Sink/Push"
_HEADER = struct.Struct(">Q")
_BIG = 1 << 30
_BASE_OPTIONS = [("grpc.max_receive_message_length", _BIG),
                 ("grpc.max_send_message_length", _BIG)]
_TUNED_OPTIONS = [*_BASE_OPTIONS, ("grpc.http2.lookahead_bytes", 16 << 20)]
_SSAI = "net.ipv4.tcp_slow_start_after_idle"


# ---------------------------------------------------------------- server (node 1)
def _serve_tcp_connection(conn: socket.socket) -> None:
    with conn:
        while True:
            header = _recv_exact(conn, _HEADER.size)
            if header is None:
                return
            remaining = _HEADER.unpack(header)[0]
            while remaining:
                chunk = conn.recv(min(remaining, 1 << 20))
                if not chunk:
                    return
                remaining -= len(chunk)
            conn.sendall(b"k")


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def serve(host: str) -> None:
    """Serve the raw TCP sink and the gRPC sink until killed."""
    import threading

    import grpc

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4),
                         options=_TUNED_OPTIONS if os.environ.get("BENCH_TUNED") else
                         _BASE_OPTIONS)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Sink", {"Push": handler}),))
    server.add_insecure_port(f"{host}:{_GRPC_PORT}")
    server.start()
    listener = socket.create_server((host, _TCP_PORT))
    print("serving", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_tcp_connection, args=(conn,), daemon=True).start()


# ---------------------------------------------------------------- client (node 0)
def _client_tcp(server: str, size: int, repeats: int, idle_s: float) -> list[float]:
    payload = _HEADER.pack(size) + os.urandom(size)
    times = []
    with socket.create_connection((server, _TCP_PORT), timeout=300) as conn:
        for _ in range(repeats):
            if idle_s:
                time.sleep(idle_s)
            start = time.perf_counter()
            conn.sendall(payload)
            if _recv_exact(conn, 1) != b"k":
                raise RuntimeError("the TCP sink closed the connection")
            times.append(time.perf_counter() - start)
    return times


def _client_grpc(server: str, size: int, repeats: int, idle_s: float, objects: int,
                 tuned: bool) -> list[float]:
    import grpc

    payload = os.urandom(size)
    pieces = [payload[i * size // objects:(i + 1) * size // objects] for i in range(objects)]
    options = _TUNED_OPTIONS if tuned else _BASE_OPTIONS
    times = []
    with grpc.insecure_channel(f"{server}:{_GRPC_PORT}", options=options) as channel:
        push = channel.unary_unary(_METHOD)
        push(b"", timeout=60)  # connect (not timed)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            for _ in range(repeats):
                if idle_s:
                    time.sleep(idle_s)
                start = time.perf_counter()
                if objects == 1:
                    push(payload, timeout=600)
                else:
                    list(pool.map(lambda piece: push(piece, timeout=600), pieces))
                times.append(time.perf_counter() - start)
    return times


def client(server: str, mode: str, size: int, repeats: int, idle_s: float,
           objects: int) -> list[float]:
    """Send ``repeats`` messages of ``size`` bytes in ``mode``; return each one's seconds."""
    idle = idle_s if mode.endswith("idle") or mode.endswith("ssai0") else 0.0
    if mode.startswith("tcp"):
        return _client_tcp(server, size, repeats, idle)
    return _client_grpc(server, size, repeats, idle, objects if mode == "grpc-objects" else 1,
                        tuned=mode == "grpc-tuned")


# ---------------------------------------------------------------- driver (root namespace)
def _qdisc_counts(net: Testbed) -> dict[str, int]:
    totals = {"drops": 0, "overlimits": 0, "requeues": 0}
    for ns, dev in ((net.namespace(0), "eth0"), (net.hub, "p0")):
        out = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        for qdisc in json.loads(out or "[]"):
            for key in totals:
                totals[key] += int(qdisc.get(key, 0))
    return totals


def _set_ssai(net: Testbed, value: int) -> None:
    for node in range(net.num_nodes):
        subprocess.run([*net.exec_prefix(node), "sysctl", "-q", "-w", f"{_SSAI}={value}"],
                       check=True, timeout=30)


def _cell(net: Testbed, mode: str, size: int, repeats: int, idle_s: float, objects: int,
          rate_Bps: float) -> dict[str, Any]:
    resent = [net.tcp_retransmitted_segments(n) for n in range(net.num_nodes)]
    qdisc = _qdisc_counts(net)
    argv = [*net.exec_prefix(0), sys.executable, "-m", "simulations.bench_link_transfer",
            "client", "--server", net.address(1), "--mode", mode, "--size", str(size),
            "--repeats", str(repeats), "--idle-s", str(idle_s), "--objects", str(objects)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"client failed: {done.stderr[-2000:]}")
    times = json.loads(done.stdout.strip().splitlines()[-1])
    after = _qdisc_counts(net)
    predicted = size / rate_Bps
    return {
        "mode": mode, "bytes": size, "rate_Bps": rate_Bps, "times_s": times,
        "first_s": times[0], "median_s": statistics.median(times),
        "predicted_s": predicted, "ratio_median": statistics.median(times) / predicted,
        "retransmitted": [net.tcp_retransmitted_segments(n) - resent[n]
                          for n in range(net.num_nodes)],
        "qdisc": {key: after[key] - qdisc[key] for key in after},
        "load_1min": os.getloadavg()[0],
    }


def bench(rates_mbit: Sequence[float], sizes_mb: Sequence[float], modes: Sequence[str],
          repeats: int, idle_s: float, objects: int, big_mb: float | None) -> list[dict[str, Any]]:
    """Every (rate, mode, size) cell on a fresh two-namespace testbed per rate."""
    cells = []
    for mbit in rates_mbit:
        rate = mbit * 1e6 / 8
        with Testbed([LinkRates(rate, rate), LinkRates()]) as net:
            server = subprocess.Popen(
                [*net.exec_prefix(1), sys.executable, "-m", "simulations.bench_link_transfer",
                 "serve", "--host", net.address(1)],
                stdout=subprocess.PIPE, text=True)
            try:
                assert server.stdout is not None
                if server.stdout.readline().strip() != "serving":
                    raise RuntimeError("the sink did not start")
                for mode in modes:
                    if mode == "tcp-idle-ssai0":
                        _set_ssai(net, 0)
                    sizes = [*sizes_mb, *([big_mb] if big_mb and mode in ("tcp", "grpc")
                                          else [])]
                    for mb in sizes:
                        reps = 1 if mb == big_mb else (2 if mb >= 10 else repeats)
                        cell = _cell(net, mode, round(mb * 1e6), reps, idle_s, objects, rate)
                        cell["mbit"] = mbit
                        cells.append(cell)
                        print(_row(cell), flush=True)
                    if mode == "tcp-idle-ssai0":
                        _set_ssai(net, 1)
            finally:
                server.terminate()  # the process we started, by its handle
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(timeout=10)
    return cells


HEADER = ("| Mbit/s | mode | MB | first s | median s | bytes/rate s | median / predicted "
          "| resent (client, server) | qdisc drops / overlimits | load |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def _row(cell: dict[str, Any]) -> str:
    return (f"| {cell['mbit']:g} | {cell['mode']} | {cell['bytes'] / 1e6:g} "
            f"| {cell['first_s']:.3f} | {cell['median_s']:.3f} | {cell['predicted_s']:.3f} "
            f"| {cell['ratio_median']:.2f} | {cell['retransmitted'][0]}, "
            f"{cell['retransmitted'][1]} | {cell['qdisc']['drops']} / "
            f"{cell['qdisc']['overlimits']} | {cell['load_1min']:.1f} |")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``serve`` and ``client`` run inside namespaces; the default drives."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", default="drive", choices=("drive", "serve", "client"))
    parser.add_argument("--host", default="")
    parser.add_argument("--server", default="")
    parser.add_argument("--mode", default="tcp", choices=MODES)
    parser.add_argument("--size", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--objects", type=int, default=32,
                        help="unary calls per message in grpc-objects")
    parser.add_argument("--rates-mbit", default="10,100")
    parser.add_argument("--sizes-mb", default="0.3,1,3,10")
    parser.add_argument("--big-mb", type=float, default=None,
                        help="one extra message of this size in tcp and grpc (e.g. 45)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.role == "serve":
        serve(args.host)
        return 0
    if args.role == "client":
        print(json.dumps(client(args.server, args.mode, args.size, args.repeats, args.idle_s,
                                args.objects)))
        return 0
    check_support()
    start = time.monotonic()
    print(f"uptime: {os.getloadavg()}")
    print(HEADER, flush=True)
    cells = bench([float(r) for r in args.rates_mbit.split(",")],
                  [float(s) for s in args.sizes_mb.split(",")],
                  [m for m in args.modes.split(",") if m], args.repeats, args.idle_s,
                  args.objects, args.big_mb)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "cells": cells, "runtime_s": time.monotonic() - start,
            "host": {"cpus": os.cpu_count(), "kernel": platform.release()},
            "command": " ".join(sys.argv)}, indent=1))
    print(f"runtime {time.monotonic() - start:.0f} s, load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
