"""The testbed's network: Linux network namespaces, veth links and ``tc`` shaping.

One namespace per node (address ``10.77.0.(10+i)/24`` on ``eth0``) and a hub
namespace whose bridge joins the nodes' veth peers ``p<i>``; nothing is added to the
calling namespace. Node ``i``'s uplink is an ``htb`` class at its uplink rate with one
child class per peer at the per-link rate; its downlink an ``htb`` class on ``p<i>``.
Segmentation offload is off; there is no latency (no ``netem``). :meth:`Testbed.down`
deletes exactly the namespaces this object created, after killing the processes in
them; it is idempotent and runs on exit, error and Ctrl-C. :func:`cleanup_recorded`
removes the namespaces of a record file. Topology and clean-up: docs/testbed.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "LinkRates",
    "Testbed",
    "TestbedError",
    "TestbedUnsupported",
    "check_support",
    "cleanup_recorded",
    "enter_netns",
    "run_in_netns",
]

_T = TypeVar("_T")
_CLONE_NEWNET = 0x40000000
_SUBNET_PREFIX = "10.77.0."
_FIRST_HOST = 10
MAX_NODES = 240
#: Seconds any one ``ip``/``tc`` command may take.
_COMMAND_TIMEOUT_S = 30.0
_CLASS_SENT = re.compile(r"class htb 1:([0-9a-f]+) .*\n\s*Sent (\d+) bytes")


class TestbedError(RuntimeError):
    """Building, shaping or tearing down the testbed network failed."""

    __test__ = False  # not a pytest test class


class TestbedUnsupported(TestbedError):
    """This machine cannot run the testbed (not root, no iproute2, kernel lacks a feature)."""


@dataclass(frozen=True)
class LinkRates:
    """Shaping of one node's access link, in bytes per second (None: unlimited).

    Attributes
    ----------
    uplink_Bps : float or None
        Cap of everything the node sends.
    downlink_Bps : float or None
        Cap of everything the node receives.
    per_peer_Bps : Mapping[int, float]
        Cap of what it sends to node ``j`` (``<= uplink_Bps``); unlisted peers
        share the uplink.
    """

    uplink_Bps: float | None = None
    downlink_Bps: float | None = None
    per_peer_Bps: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rates = [self.uplink_Bps, self.downlink_Bps, *self.per_peer_Bps.values()]
        for rate in rates:
            if rate is not None and not (rate >= 1000.0 and rate < 1e12):
                raise ValueError(f"link rate must be in [1000, 1e12) bytes/s, got {rate}")


def _run(argv: Sequence[str], what: str) -> str:
    """Run one ``ip``/``tc`` command; raise :class:`TestbedError` naming it on failure."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"{what}: `{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise TestbedError(
            f"{what}: `{' '.join(argv)}` exited with {done.returncode}: "
            f"{(done.stderr or done.stdout).strip()}"
        )
    return done.stdout


def _bits(rate_Bps: float) -> str:
    return f"{round(rate_Bps * 8)}bit"


def _burst(rate_Bps: float) -> str:
    # Two MTU-sized packets or 2 ms worth of the rate: enough for the qdisc timers, and
    # small against a model message, so that a message on an idle link is not sent at
    # line rate from a full bucket (docs/testbed.md, Topology).
    return f"{max(3200, round(rate_Bps * 0.002))}b"


def check_support() -> None:
    """Raise :class:`TestbedUnsupported` naming what is missing; return if all is there.

    Checks root (``CAP_NET_ADMIN``), the ``ip`` and ``tc`` commands, and, in a
    throw-away namespace, network namespaces, veth pairs, the ``htb`` qdisc and
    the ``u32`` classifier.
    """
    if os.geteuid() != 0:
        raise TestbedUnsupported(
            "the testbed needs root (CAP_NET_ADMIN) to create network namespaces; "
            f"running as uid {os.geteuid()}"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedUnsupported(f"the `{tool}` command (iproute2) is not installed")
    probe = f"fdt{secrets.token_hex(3)}-probe"
    steps: list[tuple[str, list[str]]] = [
        ("network namespaces", ["ip", "netns", "add", probe]),
        ("veth pairs", ["ip", "-n", probe, "link", "add", "name", "va", "type", "veth",
                        "peer", "name", "vb"]),
        ("the htb qdisc (CONFIG_NET_SCH_HTB)",
         ["tc", "-n", probe, "qdisc", "add", "dev", "va", "root", "handle", "1:", "htb"]),
        ("htb classes", ["tc", "-n", probe, "class", "add", "dev", "va", "parent", "1:",
                         "classid", "1:1", "htb", "rate", "1mbit"]),
        ("the u32 classifier (CONFIG_NET_CLS_U32)",
         ["tc", "-n", probe, "filter", "add", "dev", "va", "parent", "1:", "protocol", "ip",
          "prio", "1", "u32", "match", "ip", "dst", "10.77.0.1/32", "flowid", "1:1"]),
    ]
    created = False
    try:
        for feature, argv in steps:
            try:
                _run(argv, feature)
            except TestbedError as exc:
                raise TestbedUnsupported(f"this kernel/host lacks {feature}: {exc}") from None
            created = True
    finally:
        if created:
            with contextlib.suppress(TestbedError):
                _run(["ip", "netns", "delete", probe], "delete the probe namespace")


def _tcp_retransmitted_segments() -> int:
    # /proc/thread-self: this thread's namespace (/proc/self is the whole process's).
    lines = [line.split() for line in
             Path("/proc/thread-self/net/snmp").read_text().splitlines()
             if line.startswith("Tcp:")]
    if len(lines) != 2 or "RetransSegs" not in lines[0]:
        raise TestbedError("no Tcp RetransSegs counter in /proc/net/snmp")
    return int(lines[1][lines[0].index("RetransSegs")])


def enter_netns(namespace: str) -> None:
    """Move the calling *thread*, one made for it, into network namespace ``namespace``."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in_netns(namespace: str, fn: Callable[[], _T]) -> _T:
    """Call ``fn`` in a helper thread that has entered network namespace ``namespace``.

    Only that thread switches (``setns`` on a thread), so the caller's own
    namespace never changes; sockets ``fn`` creates belong to ``namespace``.
    """
    result: list[_T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            enter_netns(namespace)
            result.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


class Testbed:
    """A star network of namespaces, one per node (see the module docstring).

    Parameters
    ----------
    rates : sequence of LinkRates
        One entry per node; ``len(rates)`` nodes are built.
    record : path, optional
        JSON file that lists the namespaces as they are created (for
        :func:`cleanup_recorded` after a crash); removed by :meth:`down`.
    run_id : str, optional
        Part of every namespace name; random by default.

    Use as a context manager: ``with Testbed(rates) as net: ...`` builds the
    network and always tears it down.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        rates: Sequence[LinkRates],
        *,
        record: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
    ) -> None:
        if not 1 <= len(rates) <= MAX_NODES:
            raise ValueError(f"the testbed holds 1..{MAX_NODES} nodes, got {len(rates)}")
        for i, rate in enumerate(rates):
            bad = [j for j in rate.per_peer_Bps if not (0 <= j < len(rates)) or j == i]
            if bad:
                raise ValueError(f"node {i}: per-peer rates name invalid peers {bad}")
        self.rates = list(rates)
        self.run_id = run_id or secrets.token_hex(3)
        self.record = Path(record) if record is not None else None
        self.hub = f"fdt{self.run_id}-hub"
        self._created: list[str] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------ names
    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.rates)

    def namespace(self, node: int) -> str:
        """Name of node ``node``'s namespace."""
        self._check(node)
        return f"fdt{self.run_id}-n{node}"

    def address(self, node: int) -> str:
        """IPv4 address of node ``node`` (inside its namespace only)."""
        self._check(node)
        return f"{_SUBNET_PREFIX}{_FIRST_HOST + node}"

    def exec_prefix(self, node: int) -> list[str]:
        """Command prefix that runs a program inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    @property
    def namespaces(self) -> list[str]:
        """The namespaces created so far (and not yet deleted)."""
        with self._lock:
            return list(self._created)

    def _check(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} outside 0..{self.num_nodes - 1}")

    # ------------------------------------------------------------ build / tear down
    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create every namespace, link and qdisc; on any failure tear down what exists."""
        try:
            self._add_namespace(self.hub)
            _run(["ip", "-n", self.hub, "link", "add", "name", "br0", "type", "bridge"],
                 "create the bridge")
            _run(["ip", "-n", self.hub, "link", "set", "br0", "up"], "bring the bridge up")
            for node in range(self.num_nodes):
                self._add_node(node)
        except BaseException:
            self.down()
            raise

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name], f"create namespace {name}")
        with self._lock:
            self._created.append(name)
        self._write_record()
        _run(["ip", "-n", name, "link", "set", "lo", "up"], f"bring lo up in {name}")
        # No IPv6: no router solicitations or neighbour discovery in the counters.
        for key in ("all", "default"):
            with contextlib.suppress(TestbedError):
                _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w",
                      f"net.ipv6.conf.{key}.disable_ipv6=1"], "disable IPv6")

    def _add_node(self, node: int) -> None:
        ns, port = self.namespace(node), f"p{node}"
        self._add_namespace(ns)
        _run(["ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth",
              "peer", "name", port, "netns", self.hub], f"create the veth pair of node {node}")
        for where, dev in ((ns, "eth0"), (self.hub, port)):
            _run(["ip", "-n", where, "link", "set", "dev", dev, "gso_max_size", "1500"],
                 f"turn segmentation offload off on {dev}")
        _run(["ip", "-n", self.hub, "link", "set", port, "master", "br0"], "attach to bridge")
        _run(["ip", "-n", self.hub, "link", "set", port, "up"], f"bring {port} up")
        _run(["ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0"],
             f"address node {node}")
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"], f"bring eth0 of node {node} up")
        self.set_rates(node, self.rates[node])

    def set_rates(self, node: int, rates: LinkRates) -> None:
        """(Re)shape node ``node``'s access link; the old qdiscs are replaced."""
        self._check(node)
        ns, port = self.namespace(node), f"p{node}"
        for where, dev in ((ns, "eth0"), (self.hub, port)):
            with contextlib.suppress(TestbedError):  # none there yet
                _run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], "remove qdisc")
        if rates.uplink_Bps is not None or rates.per_peer_Bps:
            self._shape_uplink(node, rates)
        if rates.downlink_Bps is not None:
            tc = ["tc", "-n", self.hub]
            _run([*tc, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb",
                  "default", "1"], f"downlink qdisc of node {node}")
            _run([*tc, "class", "add", "dev", port, "parent", "1:", "classid", "1:1", "htb",
                  "rate", _bits(rates.downlink_Bps), "burst", _burst(rates.downlink_Bps),
                  "cburst", _burst(rates.downlink_Bps)], f"downlink class of node {node}")
        self.rates[node] = rates

    def _shape_uplink(self, node: int, rates: LinkRates) -> None:
        tc = ["tc", "-n", self.namespace(node)]
        total = rates.uplink_Bps or max(rates.per_peer_Bps.values())
        _run([*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default",
              "2"], f"uplink qdisc of node {node}")
        _run([*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb",
              "rate", _bits(total), "burst", _burst(total), "cburst", _burst(total)],
             f"uplink class of node {node}")
        # Children borrow from the node's uplink up to their own cap (ceil); their
        # guaranteed rate is small so that together they never exceed the uplink.
        floor = max(1000.0, total / (2 * (len(rates.per_peer_Bps) + 1)))
        children = {2: total, **{100 + j: min(r, total) for j, r in rates.per_peer_Bps.items()}}
        for minor, ceil in children.items():
            _run([*tc, "class", "add", "dev", "eth0", "parent", "1:1", "classid",
                  f"1:{minor:x}", "htb", "rate", _bits(min(floor, ceil)), "ceil", _bits(ceil),
                  "burst", _burst(ceil), "cburst", _burst(ceil)],
                 f"uplink class of node {node}")
        for peer in rates.per_peer_Bps:
            _run([*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip",
                  "prio", "1", "u32", "match", "ip", "dst", f"{self.address(peer)}/32",
                  "flowid", f"1:{100 + peer:x}"], f"classify node {node} -> {peer}")

    def down(self) -> None:
        """Kill the processes left in our namespaces, then delete them; idempotent."""
        with self._lock:
            created = list(reversed(self._created))
        errors: list[str] = []
        for name in created:
            _kill_namespace_processes(name)
            try:
                _run(["ip", "netns", "delete", name], f"delete namespace {name}")
            except TestbedError as exc:
                if name in _existing_namespaces():
                    errors.append(str(exc))
                    continue
            with self._lock:
                self._created.remove(name)
        self._write_record()
        if errors:
            raise TestbedError("could not delete every namespace: " + "; ".join(errors))

    def _write_record(self) -> None:
        if self.record is None:
            return
        with self._lock:
            names = list(self._created)
        if names:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            self.record.write_text(json.dumps({"namespaces": names}, indent=1))
        else:
            with contextlib.suppress(FileNotFoundError):
                self.record.unlink()

    # ------------------------------------------------------------ counters
    def counters(self, node: int) -> dict[str, int]:
        """Bytes and packets node ``node``'s ``eth0`` sent (tx) and received (rx) so far.

        Interface counters count whole Ethernet frames (headers included).
        """
        out = _run(["ip", "-n", self.namespace(node), "-s", "-j", "link", "show", "dev", "eth0"],
                   f"read counters of node {node}")
        stats = json.loads(out)[0]["stats64"]
        return {
            "tx_bytes": int(stats["tx"]["bytes"]),
            "tx_packets": int(stats["tx"]["packets"]),
            "rx_bytes": int(stats["rx"]["bytes"]),
            "rx_packets": int(stats["rx"]["packets"]),
        }

    def tcp_retransmitted_segments(self, node: int) -> int:
        """TCP segments the kernel of node ``node``'s namespace has retransmitted so far.

        ``RetransSegs`` of the namespace's ``/proc/net/snmp`` (all its sockets, loopback
        ones included), counted in MSS-sized segments. A retransmitted copy of a segment
        the receiver had already counted on its interface (a spurious retransmission, or
        a drop after the interface, e.g. a full socket queue) is counted there twice.
        """
        self._check(node)
        return run_in_netns(self.namespace(node), _tcp_retransmitted_segments)

    def peer_bytes(self, node: int) -> dict[int, int]:
        """Bytes node ``node`` sent to each peer with its own class (qdisc counters)."""
        out = _run(["tc", "-n", self.namespace(node), "-s", "class", "show", "dev", "eth0"],
                   f"read class counters of node {node}")
        # No JSON for htb classes in iproute2 6.x: "class htb 1:66 ...\n Sent N bytes ...".
        result: dict[int, int] = {}
        for minor, sent in _CLASS_SENT.findall(out):
            if int(minor, 16) >= 100:
                result[int(minor, 16) - 100] = int(sent)
        return result

    def all_counters(self) -> list[dict[str, int]]:
        """:meth:`counters` of every node."""
        return [self.counters(node) for node in range(self.num_nodes)]


def _existing_namespaces() -> set[str]:
    try:
        out = _run(["ip", "-j", "netns", "list"], "list namespaces")
    except TestbedError:
        return set()
    return {str(entry["name"]) for entry in json.loads(out or "[]")}


def namespace_pids(name: str) -> list[int]:
    """Ids of the processes inside namespace ``name`` (none if it cannot be listed)."""
    try:
        out = _run(["ip", "netns", "pids", name], f"list processes in {name}")
    except TestbedError:
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def running(pids: Sequence[int], program: str) -> bool:
    """Whether one of ``pids`` is still running with ``program`` in its command line."""
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(program.encode() in arg for arg in argv):
            return True
    return False


def _kill_namespace_processes(name: str, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every process inside namespace ``name`` (bounded wait)."""

    def pids() -> list[int]:
        return namespace_pids(name)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        found = pids()
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)


def cleanup_recorded(record: str | os.PathLike[str]) -> list[str]:
    """Delete the namespaces a record file lists that still exist; return their names.

    For a testbed process that was killed before it could clean up. Only names
    in the file are touched.
    """
    path = Path(record)
    data: Any = json.loads(path.read_text(encoding="utf-8"))
    names = data.get("namespaces") if isinstance(data, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise TestbedError(f"{path} is not a testbed namespace record")
    existing = _existing_namespaces()
    removed = []
    for name in reversed(names):
        if name in existing:
            _kill_namespace_processes(name)
            _run(["ip", "netns", "delete", name], f"delete namespace {name}")
            removed.append(name)
    path.unlink()
    return removed
