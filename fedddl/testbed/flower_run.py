"""A real Flower deployment on the testbed: a SuperLink and N SuperNodes, each in its namespace.

:class:`FlowerTestbed` builds ``N + 1`` namespaces (:class:`~fedddl.testbed.netns.Testbed`):
node ``i < N`` runs SuperNode ``i`` (with its warm ClientApp server), node ``N``
the SuperLink, its ServerApp and the ``flwr`` CLI. Everything is started through
the deployment harness (:mod:`fedddl.deploy.processes`) exactly as
docs/deployment.md describes: TLS (CA + server certificate naming the
SuperLink's address), SuperNode authentication (keys registered with ``flwr
supernode register``), ``--node-config 'partition-id=i num-partitions=N'``.
The SuperNodes' access links are shaped; the SuperLink's only when a profile says so
(:meth:`FlowerTestbed.set_server_rates`: one link that every SuperNode's traffic shares).

:meth:`FlowerTestbed.run` starts one ``flwr run`` with a run config and returns
the results JSON the ServerApp wrote (the schema of ``fedddl simulate``) with a
``testbed`` section added: link rates, the wire bytes counted on every
SuperNode's interface during the run, the TCP segments the SuperNodes and the
SuperLink retransmitted meanwhile, the idle traffic rate measured just before
it, the load average, and the real wall-clock time to the target. Beside the results,
``<run>.activity.json`` keeps every node's link bytes and the machine's busy CPU time
every :data:`ACTIVITY_INTERVAL_S` (:mod:`fedddl.testbed.activity` cuts rounds out of it).
Several runs reuse one deployment, so compared runs share the same processes.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedddl.deploy.certs import write_supernode_keys, write_tls_material
from fedddl.deploy.processes import (
    DeploymentError,
    ManagedProcess,
    ProcessRegistry,
    flower_env,
    format_node_config,
    register_supernode,
    run_flwr,
    start_process,
    start_superlink,
    start_supernode,
    tcp_accepts,
    write_flwr_config,
)
from fedddl.testbed.activity import ActivitySampler
from fedddl.testbed.netns import LinkRates, Testbed, namespace_pids, run_in_netns, running

__all__ = ["RETRANSMITTED_SEGMENT_BYTES", "SUPERLINK_PORT", "TCP_OVERHEAD", "FlowerTestbed",
           "RunTimeout", "activity_path", "fab_size", "time_to_target", "wire_bounds"]


class RunTimeout(DeploymentError):
    """A run went past its time bound (``FlowerTestbed.run(timeout_s=...)``) and was stopped."""

#: Port of the SuperLink inside its own namespace (nothing else listens there).
SUPERLINK_PORT = 9092
_PRELOAD = ("torch", "numpy", "sklearn.datasets", "fedddl.compression.warmup:warm_up",
            "fedddl.flower.object_pull:patch_clientapp_pulls")
_CONNECTION = "testbed"
#: Seconds between the samples of the links' and CPUs' activity (`<run>.activity.json`).
ACTIVITY_INTERVAL_S = 0.1

_SEGMENT = 1448  # payload bytes of a full TCP segment at MTU 1500 (with timestamps)
_FRAMING = 66  # Ethernet (14) + IPv4 (20) + TCP with timestamps (32)
#: Framing bytes per payload byte of full segments (offloads are off on the testbed's
#: veths, so the interfaces count real segments).
TCP_OVERHEAD = _FRAMING / _SEGMENT
#: One 66-byte ACK per two full segments in the other direction (delayed ACKs).
ACK_OVERHEAD = _FRAMING / (2 * _SEGMENT)
#: Wire bytes of one retransmitted full segment (payload + framing).
RETRANSMITTED_SEGMENT_BYTES = _SEGMENT + _FRAMING


def wire_bounds(testbed: Mapping[str, Any], slack: float = 0.10) -> dict[str, tuple[float, float]]:
    """Band ``(low, high)`` the SuperNodes' interface bytes of a run must fall in, per direction.

    The payload of a direction is the application's count (``bytes_up``; for ``bytes_down``
    plus one app bundle per SuperNode). ``low`` = payload x (1 + :data:`TCP_OVERHEAD`) + the
    ACKs for the other direction's payload; ``high`` = (``low`` + the idle traffic rate x the
    run's duration + the retransmitted segments x :data:`RETRANSMITTED_SEGMENT_BYTES`) x
    (1 + ``slack``). Keys ``"tx_bytes"`` and ``"rx_bytes"``; why ``slack`` is 10 %:
    docs/testbed.md.
    """
    app = testbed["app_bytes"]
    down = float(app["down"]) + testbed["supernodes"] * float(app["fab_per_supernode"])
    up = float(app["up"])
    retransmitted = testbed.get("retransmitted_segments", {})
    bounds = {}
    for key, payload, other, idle, sender in (("tx_bytes", up, down, "tx", "supernodes"),
                                              ("rx_bytes", down, up, "rx", "superlink")):
        low = payload * (1 + TCP_OVERHEAD) + other * ACK_OVERHEAD
        resent = float(retransmitted.get(sender, 0)) * RETRANSMITTED_SEGMENT_BYTES
        high = (low + testbed["idle_rate_Bps"][idle] * testbed["run_s"] + resent) * (1 + slack)
        bounds[key] = (low, high)
    return bounds


def fab_size(app_dir: str | os.PathLike[str], env: Mapping[str, str]) -> int:
    """Bytes of the app bundle (FAB) ``flwr run`` sends for ``app_dir`` (``flwr build``)."""
    with tempfile.TemporaryDirectory(prefix="fedddl-fab-") as tmp:
        result = run_flwr(["build", "--app", str(Path(app_dir).resolve())], env=env, cwd=tmp,
                          timeout_s=120.0)
        fabs = list(Path(tmp).glob("*.fab"))
        if result.returncode != 0 or len(fabs) != 1:
            raise DeploymentError(f"flwr build failed (exit {result.returncode}):\n{result.stdout}")
        return fabs[0].stat().st_size


def time_to_target(result: Mapping[str, Any], target: float) -> float | None:
    """Real seconds from the start of round 1 to the end of the first round whose accuracy
    is ``>= target`` (cumulative ``wall_s``), or None if no round reached it. Rounds that
    were not evaluated (``eval-every`` > 1: accuracy None) count only their time."""
    elapsed = 0.0
    for record in sorted(result["rounds"], key=lambda r: int(r["round"])):
        elapsed += float(record["wall_s"])
        if record["accuracy"] is not None and float(record["accuracy"]) >= target:
            return elapsed
    return None


class FlowerTestbed:
    """SuperLink + N SuperNodes in their own network namespaces (see the module docstring).

    Parameters
    ----------
    client_rates : sequence of LinkRates
        Access link of each SuperNode (``per_peer_Bps`` must be empty).
    work_dir : path
        Logs, certificates, ``FLWR_HOME`` directories and the namespace record.
    app_dir : path
        The Flower app ``flwr run`` builds (the repository root).
    tls : bool
        TLS + SuperNode authentication as in docs/deployment.md (default), or insecure.
    start_timeout_s : float
        Bound on each process start.
    heartbeat_patience : int, optional
        Missed 30 s heartbeats the SuperLink and SuperNodes tolerate before a ServerApp,
        ClientApp or SuperNode counts as gone (Flower: 2;
        :mod:`fedddl.flower.heartbeat_patience`).
    """

    def __init__(
        self,
        client_rates: Sequence[LinkRates],
        work_dir: str | os.PathLike[str],
        app_dir: str | os.PathLike[str],
        *,
        tls: bool = True,
        start_timeout_s: float = 180.0,
        heartbeat_patience: int | None = None,
    ) -> None:
        if not client_rates:
            raise ValueError("a Flower testbed needs at least one SuperNode")
        if any(r.per_peer_Bps for r in client_rates):
            raise ValueError("SuperNodes talk to the SuperLink only: no per-peer rates")
        self.work = Path(work_dir).resolve()  # Flower config files need absolute paths
        self.app_dir = Path(app_dir)
        self.tls = tls
        self.start_timeout_s = start_timeout_s
        self.heartbeat_patience = heartbeat_patience
        self.num_supernodes = len(client_rates)
        self.net = Testbed([*client_rates, LinkRates()], record=self.work / "namespaces.json")
        self.server = self.num_supernodes  # node index of the SuperLink's namespace
        self.processes = ProcessRegistry()
        self.logs = self.work / "logs"
        self.home = self.work / "flwr-home"
        self.env: dict[str, str] = {}
        self.superlink: ManagedProcess | None = None
        self.supernodes: list[ManagedProcess] = []

    @property
    def superlink_address(self) -> str:
        """``host:port`` the SuperNodes and the CLI reach the SuperLink at."""
        return f"{self.net.address(self.server)}:{SUPERLINK_PORT}"

    def __enter__(self) -> FlowerTestbed:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Build the network, start the SuperLink and every SuperNode (admitted)."""
        self.work.mkdir(parents=True, exist_ok=True)
        self.net.up()
        self.env = flower_env(self.home)
        server_prefix = self.net.exec_prefix(self.server)
        server_ns = self.net.namespace(self.server)
        host = self.net.address(self.server)
        tls_paths = None
        keys = []
        if self.tls:
            tls_paths = write_tls_material(self.work / "certs", [host, "127.0.0.1", "localhost"])
            names = [f"supernode-{i}" for i in range(self.num_supernodes)]
            keys = write_supernode_keys(self.work / "certs" / "supernode-keys", names)

        def probe(_host: str, port: int) -> bool:
            return run_in_netns(server_ns, lambda: tcp_accepts(host, port))

        self.superlink = self.processes.add(start_superlink(
            self.logs, env=self.env, tls=tls_paths, enable_supernode_auth=self.tls,
            host="0.0.0.0", port=SUPERLINK_PORT, prefix=server_prefix, probe=probe,
            timeout_s=self.start_timeout_s, heartbeat_patience=self.heartbeat_patience,
        ))
        write_flwr_config(self.home, {_CONNECTION: self.superlink_address},
                          root_certificate=tls_paths.ca_certificate if tls_paths else None)
        for key in keys:
            register_supernode(key.public_key, _CONNECTION, env=self.env, prefix=server_prefix)
        for i in range(self.num_supernodes):
            node_env = flower_env(self.work / f"flwr-home-node{i}")
            self.supernodes.append(self.processes.add(start_supernode(
                f"supernode-{i}", self.superlink_address, self.logs, env=node_env,
                root_certificate=tls_paths.ca_certificate if tls_paths else None,
                auth_private_key=keys[i].private_key if keys else None,
                node_config={"partition-id": i, "num-partitions": self.num_supernodes},
                warm_clientapp_preload=_PRELOAD, prefix=self.net.exec_prefix(i),
                timeout_s=self.start_timeout_s, heartbeat_patience=self.heartbeat_patience,
            )))

    def stop(self) -> None:
        """Stop every process, then delete every namespace; idempotent."""
        try:
            self.processes.stop_all()
        finally:
            self.net.down()

    def set_client_rates(self, rates: Sequence[LinkRates]) -> None:
        """Reshape the SuperNodes' access links (between runs)."""
        if len(rates) != self.num_supernodes:
            raise ValueError(f"{len(rates)} rates for {self.num_supernodes} SuperNodes")
        for i, rate in enumerate(rates):
            self.net.set_rates(i, rate)

    def set_server_rates(self, rates: LinkRates) -> None:
        """Reshape the SuperLink's own access link, shared by every SuperNode (between runs)."""
        if rates.per_peer_Bps:
            raise ValueError("the SuperLink's link takes no per-peer rates")
        self.net.set_rates(self.server, rates)

    def _wire_totals(self) -> dict[str, int]:
        counters = [self.net.counters(i) for i in range(self.num_supernodes)]
        return {key: sum(c[key] for c in counters) for key in counters[0]}

    def _retransmitted(self) -> dict[str, int]:
        return {
            "supernodes": sum(self.net.tcp_retransmitted_segments(i)
                              for i in range(self.num_supernodes)),
            "superlink": self.net.tcp_retransmitted_segments(self.server),
        }

    def run(
        self,
        run_config: Mapping[str, str | int | float | bool],
        name: str,
        *,
        target: float | None = None,
        idle_window_s: float = 3.0,
        timeout_s: float = 1800.0,
    ) -> dict[str, Any]:
        """Run ``flwr run`` once with ``run_config``; return its results with a ``testbed`` section.

        Parameters
        ----------
        run_config : mapping
            Run-config keys (kebab-case, as in ``pyproject.toml``); ``results-path``
            and ``min-available-nodes`` are set by the testbed.
        name : str
            Label of the run (log and results file names).
        target : float, optional
            Accuracy whose first crossing gives ``testbed.time_to_target_s``.
        idle_window_s : float
            Seconds of idle traffic (SuperNode polls) counted before the run.
        timeout_s : float
            Bound on the whole run; it is stopped and an error raised after it.
        """
        if self.superlink is None:
            raise RuntimeError("start the testbed first")
        results_path = (self.work / "results" / f"{name}.json").resolve()
        results_path.unlink(missing_ok=True)
        config = {**run_config, "results-path": str(results_path),
                  "min-available-nodes": self.num_supernodes}
        idle_start, t_idle = self._wire_totals(), time.monotonic()
        time.sleep(idle_window_s)
        before, t0 = self._wire_totals(), time.monotonic()
        resent_before = self._retransmitted()
        load_before = os.getloadavg()
        sampler = ActivitySampler(self.net.hub, [f"p{i}" for i in range(self.net.num_nodes)],
                                  ACTIVITY_INTERVAL_S).start()
        try:
            result, cli_s = self._run_flwr(config, name, results_path, t0, timeout_s)
        finally:
            samples = sampler.stop()
        after, t1 = self._wire_totals(), time.monotonic()
        resent_after = self._retransmitted()
        fab = fab_size(self.app_dir, self.env)
        activity_path(self.work, name).write_text(json.dumps(
            {"interval_s": ACTIVITY_INTERVAL_S, "columns": self._activity_columns(),
             "samples": samples, "error": None if sampler.error is None else repr(sampler.error)}))
        idle_s = t0 - t_idle
        result["testbed"] = {
            "name": name,
            "supernodes": self.num_supernodes,
            "tls": self.tls,
            "heartbeat_patience": self.heartbeat_patience,
            "client_links": [_rates_dict(r) for r in self.net.rates[: self.num_supernodes]],
            "server_link": _rates_dict(self.net.rates[self.server]),
            "latency_emulated": False,
            "run_s": t1 - t0,
            "flwr_run_s": cli_s,
            "wire": {key: after[key] - before[key] for key in after},
            "retransmitted_segments": {key: resent_after[key] - resent_before[key]
                                       for key in resent_after},
            "idle_rate_Bps": {
                "tx": (before["tx_bytes"] - idle_start["tx_bytes"]) / idle_s,
                "rx": (before["rx_bytes"] - idle_start["rx_bytes"]) / idle_s,
            },
            "app_bytes": {
                "up": sum(int(r["bytes_up"]) for r in result["rounds"]),
                "down": sum(int(r["bytes_down"]) for r in result["rounds"]),
                "fab_per_supernode": fab,
            },
            "target": target,
            "time_to_target_s": None if target is None else time_to_target(result, target),
            "load_avg_before": list(load_before),
            "load_avg_after": list(os.getloadavg()),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                     "kernel": platform.release()},
        }
        results_path.write_text(json.dumps(result, indent=1))
        return result

    def _activity_columns(self) -> list[str]:
        columns = ["unix_s", "busy_cpu_s"]
        for i in range(self.net.num_nodes):
            node = "superlink" if i == self.server else f"supernode{i}"
            columns += [f"{node}_sent_B", f"{node}_received_B"]
        return columns

    def _run_flwr(self, config: Mapping[str, Any], name: str, results_path: Path, t0: float,
                  timeout_s: float) -> tuple[dict[str, Any], float]:
        """``flwr run`` to its end; its results and the CLI's seconds."""
        run = self.processes.add(start_process(
            f"flwr-run-{name}",
            ["flwr", "run", str(self.app_dir.resolve()), _CONNECTION, "--stream",
             "--run-config", format_node_config(config)],
            self.logs, env=self.env, prefix=self.net.exec_prefix(self.server),
        ))
        deadline = time.monotonic() + timeout_s
        while run.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if run.alive():
            run.stop()
            raise RunTimeout(
                f"flwr run {name} exceeded {timeout_s} s (fedddl testbed flower --run-timeout)"
                f":\n{run.log_text()[-3000:]}"
            )
        # `flwr run --stream` may return while its ServerApp still works (its log stream
        # ended, seen with 45 MB messages on a loaded machine): wait for the ServerApp.
        cli_s = time.monotonic() - t0
        server_ns = self.net.namespace(self.server)
        while (not results_path.exists() and time.monotonic() < deadline
               and running(namespace_pids(server_ns), "flwr-serverapp")):
            time.sleep(0.5)
        if run.popen.returncode != 0 or not results_path.exists():
            raise DeploymentError(
                f"flwr run {name} failed (exit {run.popen.returncode}):\n{run.log_text()[-4000:]}"
            )
        result: dict[str, Any] = json.loads(results_path.read_text())
        return result, cli_s


def activity_path(work_dir: str | os.PathLike[str], name: str) -> Path:
    """Where :meth:`FlowerTestbed.run` of run ``name`` keeps its activity samples."""
    return Path(work_dir) / "results" / f"{name}.activity.json"


def _rates_dict(rates: LinkRates) -> dict[str, float | None]:
    return {"uplink_Bps": rates.uplink_Bps, "downlink_Bps": rates.downlink_Bps}
