"""In-process Flower simulation of the fedddl app (Python API of ``fedddl simulate``).

This module is an entry point: it builds the ServerApp (``strategies``) and the
ClientApp (``clients``), which nothing else below the command line may import together.

``run(config, num_clients=10, engine="ray")`` builds the same ServerApp and ClientApp as
``flwr run``, binding the :class:`~fedddl.app_config.AppConfig` through factories
(in-process engines give apps an empty ``run_config``), runs them on one of two engines
and returns the results dict the ServerApp produced::

    {"config": {...}, "initial": {...},
     "rounds": [{"round", "accuracy", "loss", "bytes_up", "bytes_down",
                 "replicas_equal", "wall_s", ...}, ...],
     "final_accuracy": float, "summary": {...}, "total_s": float}

Engines (the same apps and messages, so the same bytes and replicas per round):

* ``"ray"``: Flower's simulation on Ray, ``num_cpus_per_client`` CPUs per client actor
  (several clients train at once); messages picked up when pushed and replies pulled
  when stored instead of on Flower's 0.1 s ticks (:mod:`fedddl.flower.message_pickup`);
  client replica snapshots in a temporary directory unless ``client-snapshot-dir`` says
  otherwise (:mod:`clients.snapshot_files`).
* ``"inline"``: :func:`fedddl.flower.inline_grid.run_inline`, every client in this process
  one after another, no Ray; replies in node order, so a run replays exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedddl.app_config import AppConfig
from fedddl.partition_check import check_run_partition

__all__ = ["ENGINES", "ray_failed_to_start", "run"]

#: The in-process engines of :func:`run`.
ENGINES = ("ray", "inline")

_OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_DEDUP_LOGS": "0",
}


_RAY_START_ATTEMPTS = 2
#: Messages of Ray's node failing to start: the raylet not registering in time, and the GCS
#: server not writing its port file in time (both seen on a loaded 2-core machine).
_RAY_START_FAILURES = ("timed out during startup", "Timed out waiting for file")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _root_cause(error: BaseException) -> str:
    return str(_causes(error)[-1]).split(".")[0]


def ray_failed_to_start(error: BaseException) -> bool:
    """Whether ``error`` (from ``run_simulation``) is Ray's node failing to start."""
    return any(marker in str(cause) for cause in _causes(error) for marker in _RAY_START_FAILURES)


def _shutdown_ray() -> None:
    try:
        import ray

        ray.shutdown()
    except Exception as error:  # best effort before the second attempt
        _stderr(f"fedddl simulate: ray.shutdown() failed: {error}")


def _run_ray(
    cfg: AppConfig,
    sink: Callable[[dict[str, Any]], None],
    progress: Callable[[str], None] | None,
    *,
    num_clients: int,
    num_cpus_per_client: float,
    num_gpus_per_client: float,
    verbose_logging: bool,
) -> None:
    """Run the apps on Flower's Ray simulation; start Ray once more if its node fails to."""
    from flwr.simulation import run_simulation

    from clients.client_app import make_client_app
    from fedddl.flower.message_pickup import quick_message_pickup
    from strategies.server_app import make_server_app

    for attempt in range(1, _RAY_START_ATTEMPTS + 1):
        try:
            with quick_message_pickup(num_clients):
                run_simulation(
                    server_app=make_server_app(cfg, sink=sink, progress=progress),
                    client_app=make_client_app(cfg),
                    num_supernodes=num_clients,
                    backend_config={
                        "client_resources": {
                            "num_cpus": num_cpus_per_client,
                            "num_gpus": num_gpus_per_client,
                        },
                        "init_args": {"logging_level": "warning", "log_to_driver": True},
                    },
                    verbose_logging=verbose_logging,
                )
            return
        except RuntimeError as error:
            if attempt == _RAY_START_ATTEMPTS or not ray_failed_to_start(error):
                raise
            # Ray's node start (raylet registration, a fixed 30 s wait) fails now and
            # then on a loaded machine; nothing ran yet, so starting again loses nothing.
            _stderr(f"fedddl simulate: Ray did not start ({_root_cause(error)}); starting again")
            _shutdown_ray()


def _run_inline(
    cfg: AppConfig,
    sink: Callable[[dict[str, Any]], None],
    progress: Callable[[str], None] | None,
    *,
    num_clients: int,
) -> None:
    """Run the apps on the inline engine (:mod:`fedddl.flower.inline_grid`)."""
    from clients.client_app import make_client_app
    from fedddl.flower.inline_grid import run_inline
    from strategies.server_app import make_server_app

    run_inline(
        make_server_app(cfg, sink=sink, progress=progress), make_client_app(cfg), num_clients
    )


def run(
    config: AppConfig | Mapping[str, Any],
    *,
    num_clients: int = 10,
    engine: str = "ray",
    num_cpus_per_client: float = 1.0,
    num_gpus_per_client: float | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = _stderr,
    verbose_logging: bool = False,
) -> dict[str, Any]:
    """Run one Flower simulation in this process and return its results.

    Parameters
    ----------
    config : AppConfig or Mapping
        The run configuration (a mapping uses the kebab-case ``run_config`` keys).
    num_clients : int
        Simulated SuperNodes (each gets ``partition-id`` / ``num-partitions``).
    engine : str
        ``"ray"`` or ``"inline"`` (see the module docstring).
    num_cpus_per_client : float
        Ray resources per client; ``1`` runs one actor per core (``ray`` only).
    num_gpus_per_client : float | None
        Ray GPU share per client (``ray`` only). None: 0 when the run's ``device`` is the
        CPU, else ``1 / num_clients`` (every client fits on one GPU). Ray hides the GPU
        from actors that ask for none, so a CUDA run needs a share > 0.
    out : path, optional
        Where to write the results JSON as well.
    progress : Callable[[str], None] | None
        Called with one line per round (default: stderr).
    verbose_logging : bool
        Flower's DEBUG logs (``ray`` only).

    Returns
    -------
    dict
        The results (see the module docstring); ``config`` also holds ``engine``,
        ``num-clients`` and, with Ray, ``num-cpus-per-client`` and ``num-gpus-per-client``.

    Raises
    ------
    ValueError
        On a bad configuration, an unknown ``engine`` or ``num_clients`` < 1; a
        ``fedddl.partition.PartitionError`` before anything runs if ``partition`` cannot
        split the training set over ``num_clients``.
    RuntimeError
        If the simulation ended without results (the ServerApp failed).
    """
    cfg = config if isinstance(config, AppConfig) else AppConfig.from_run_config(config)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients < cfg.min_available_nodes:
        cfg = cfg.replace(min_available_nodes=num_clients)
    check_run_partition(cfg, num_clients)
    for key, value in _OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    if num_gpus_per_client is None:
        from fedddl.devices import resolve_device

        on_cpu = resolve_device(cfg.device).type == "cpu"
        num_gpus_per_client = 0.0 if on_cpu else 1.0 / num_clients
    if num_gpus_per_client < 0:
        raise ValueError(f"num_gpus_per_client must be >= 0, got {num_gpus_per_client}")

    results: list[dict[str, Any]] = []

    def sink(result: dict[str, Any]) -> None:
        results[:] = [result]

    if engine == "inline":
        # One process: every node's context.state stays here ("auto" means "state").
        _run_inline(cfg, sink, progress, num_clients=num_clients)
    else:
        with contextlib.ExitStack() as cleanup:
            if cfg.client_snapshot_dir == "auto":  # one machine: snapshot files (AppConfig)
                snapshots = cleanup.enter_context(
                    tempfile.TemporaryDirectory(prefix="fedddl-snap-")
                )
                cfg = cfg.replace(client_snapshot_dir=snapshots)
            _run_ray(
                cfg,
                sink,
                progress,
                num_clients=num_clients,
                num_cpus_per_client=num_cpus_per_client,
                num_gpus_per_client=num_gpus_per_client,
                verbose_logging=verbose_logging,
            )
    if not results:
        raise RuntimeError("the simulation ended without results (see the ServerApp log above)")
    result = results[0]
    result["config"]["engine"] = engine
    result["config"]["num-clients"] = num_clients
    if engine == "ray":
        result["config"]["num-cpus-per-client"] = num_cpus_per_client
        result["config"]["num-gpus-per-client"] = num_gpus_per_client
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    return result
