"""The fedddl ServerApp: builds the strategy, runs it, evaluates, writes the results JSON.

``app`` (used by ``flwr run``) reads its :class:`~fedddl.app_config.AppConfig` from
``context.run_config``; :func:`make_server_app` binds a given config and a ``sink`` that
receives the results dict (the ``fedddl simulate`` path).

A strategy that implements :class:`~strategies.replica_strategy.ReplicaStrategy` (the
TernGrad family) also gets per-round reports, checkpoints and resume (the ``checkpoint-*``
keys; a resume refuses a change to any of :data:`RESUME_CHECK_KEYS`) and, with ``attack``,
a roll call (:mod:`strategies.roll_call`) that names the attacking nodes; any other Flower
strategy runs with the byte counts and server-side evaluation alone. Flower's grids are
polled sooner (:func:`fedddl.flower.grid.fast_poll`); the inline engine's grid is used as
given. Checkpoint and resume in full, with the high-water mark that refuses a rollback under
``checkpoint-key-file`` (:mod:`fedddl.checkpoint_mark`): ``docs/deployment.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from fedddl.app_config import AppConfig
from fedddl.bn_momentum_choice import MODEL_OWN, resolve_bn_momentum
from fedddl.compression import takes_scale_bucket
from fedddl.downlink_choice import resolve_downlink
from fedddl.scale_bucket_choice import resolve_scale_bucket
from fedddl.sync.server import ReplicaServer
from strategies.replica_strategy import ReplicaStrategy

__all__ = [
    "RESUME_CHECK_KEYS",
    "RESUME_IGNORED_KEYS",
    "app",
    "make_server_app",
    "run_server",
    "summarize",
]

#: Run-config keys that do not change the trajectory of a run: they may differ on resume.
RESUME_IGNORED_KEYS: frozenset[str] = frozenset(
    {
        "num-server-rounds",
        "data-root",
        "results-path",
        "min-available-nodes",
        "checkpoint-dir",
        "checkpoint-every",
        "checkpoint-keep",
        "checkpoint-allow-fresh-start",
        "checkpoint-key-file",
        "client-snapshot-dir",
    }
)
#: Run-config keys that must match the checkpoint's for a resume: every other key (a key
#: the checkpoint predates counts as its default).
RESUME_CHECK_KEYS: tuple[str, ...] = tuple(
    key for key in AppConfig().to_run_config() if key not in RESUME_IGNORED_KEYS
)


def run_server(
    grid: Grid, cfg: AppConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run ``cfg.num_server_rounds`` rounds on ``grid`` and return the results dict.

    Returns
    -------
    dict
        ``{"config", "initial", "rounds": [{"round", "accuracy", "loss", "bytes_up",
        "bytes_down", "replicas_equal", "wall_s", ...}], "final_accuracy", "summary",
        "resumed_from", "final_version", "final_fingerprint"}`` (``resumed_from``: None,
        or the checkpoint's ``round``, ``version`` and ``path``; the last two: the shadow
        replica's, None without one).

    Raises
    ------
    ValueError
        If checkpointing is asked of a strategy that does not support it.
    fedddl.checkpoint.CheckpointError
        If the checkpoint to resume from does not fit this run.
    """
    from fedddl.data import as_tensors, load_dataset
    from fedddl.devices import resolve_device
    from fedddl.finite_json import finite_json
    from fedddl.flower.grid import CountingGrid, fast_poll
    from strategies.recorder import RoundRecorder, evaluation_subset
    from strategies.registry import build_strategy
    from strategies.replica_strategy import replica_strategy

    cfg.import_plugins()
    device = resolve_device(cfg.device)
    model_fn = cfg.model_factory(device=device)
    strategy = build_strategy(cfg, model_fn)
    replica = replica_strategy(strategy)
    key = _checkpoint_key(cfg)
    resumed, run_id = _resume(replica, strategy, cfg, key)
    offset = 0 if resumed is None else int(resumed["round"])
    x_test, y_test = as_tensors(load_dataset(cfg.dataset, cfg.data_root or None, split="test"))
    x_test, y_test = evaluation_subset(x_test, y_test, cfg.eval_samples, cfg.seed)
    polled = fast_poll(grid)
    attack = _attack_roll_call(polled, cfg)
    counting = CountingGrid(polled)
    saver = None
    if replica is not None and cfg.checkpoint_every > 0:
        saver = _checkpoint_saver(replica, cfg, key, run_id, offset)
    recorder = RoundRecorder(
        model_fn,
        x_test,
        y_test,
        counting,
        None if replica is None else replica.round_report,
        cfg.num_server_rounds,
        progress,
        round_offset=offset,
        on_round=saver,
        attackers=frozenset(attack["node_ids"]) if attack else frozenset(),
        global_model=None if replica is None else replica.global_model,
        eval_every=cfg.eval_every,
    )
    initial = replica.global_model() if replica is not None else model_fn()
    remaining = cfg.num_server_rounds - offset
    start = time.perf_counter()
    if remaining > 0:
        strategy.start(
            grid=counting,
            initial_arrays=ArrayRecord(initial.state_dict()),
            num_rounds=remaining,
            evaluate_fn=recorder,
        )
    else:
        log(INFO, "fedddl: checkpoint round %d >= num-server-rounds, nothing to run", offset)
        recorder(0, ArrayRecord(initial.state_dict()))
    total = time.perf_counter() - start
    config = cfg.to_run_config()
    config["num-clients"] = len(list(grid.get_node_ids()))
    config["strategy-class"] = f"{type(strategy).__module__}.{type(strategy).__qualname__}"
    config["resolved-downlink"] = cfg.resolved_downlink
    config["resolved-scale-bucket"] = _scale_bucket_used(strategy, cfg)
    config["resolved-bn-momentum"] = cfg.resolved_bn_momentum
    result: dict[str, Any] = {
        "config": config,
        "initial": recorder.initial,
        "rounds": recorder.rounds,
        "final_accuracy": recorder.rounds[-1]["accuracy"] if recorder.rounds else None,
        "total_s": total,
        "resumed_from": resumed,
        "final_version": None if replica is None else replica.model_version(),
        "final_fingerprint": None if replica is None else _fingerprint(replica),
        "attack": attack,
    }
    result["summary"] = summarize(result)
    result = finite_json(result)  # a NaN or Inf that got this far becomes null, not bad JSON
    log(INFO, "fedddl summary: %s", json.dumps(result["summary"]))
    if cfg.results_path:
        path = Path(cfg.results_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, allow_nan=False))
        log(INFO, "fedddl results written to %s", path)
    return result


def _scale_bucket_used(strategy: Strategy, cfg: AppConfig) -> int:
    """The scale buckets of the strategy's replica server (resolved for the compressor it
    names), else the run config's for its ``compressor``."""
    server = getattr(strategy, "server", None)
    if isinstance(server, ReplicaServer):
        return int(server.scale_bucket)
    return cfg.resolved_scale_bucket


def _fingerprint(replica: ReplicaStrategy) -> str:
    from fedddl.training import parameters_fingerprint

    return parameters_fingerprint(replica.global_model())


def _attack_roll_call(grid: Grid, cfg: AppConfig) -> dict[str, Any] | None:
    """Attack evaluation: which nodes hold the attacking partitions (None without attack)."""
    if cfg.num_attackers == 0:
        return None
    from fedddl.attacks import attacker_partitions
    from strategies.roll_call import roll_call

    partitions = roll_call(grid, cfg.min_available_nodes)
    num = len(partitions)
    attacking = attacker_partitions(num, cfg.num_attackers, cfg.seed)
    nodes = sorted(node for node, pid in partitions.items() if pid in attacking)
    log(INFO, "fedddl: attack %s from partitions %s (nodes %s)", cfg.attack, attacking, nodes)
    return {
        "attack": cfg.attack,
        "num_attackers": cfg.num_attackers,
        "partition_ids": attacking,
        "node_ids": nodes,
    }


def _checkpoint_key(cfg: AppConfig) -> bytes | None:
    from fedddl.checkpoint import read_key_file

    return read_key_file(cfg.checkpoint_key_file) if cfg.checkpoint_key_file else None


def _resume(
    replica: ReplicaStrategy | None, strategy: Strategy, cfg: AppConfig, key: bytes | None
) -> tuple[dict[str, Any] | None, str]:
    """Restore ``replica`` from the newest checkpoint in ``cfg.checkpoint_dir``, if any;
    return what was resumed (None: nothing) and the run's identity (the checkpoint's, or a
    new one)."""
    from fedddl.checkpoint_dir import load_latest_checkpoint
    from fedddl.checkpoint_mark import new_run_id

    if cfg.checkpoint_every > 0 and replica is None:
        raise ValueError(
            "checkpoint-every needs a TernGrad-family strategy (a ReplicaStrategy, which "
            f"checkpoints), not {type(strategy).__name__}"
        )
    if not cfg.checkpoint_dir:
        return None, new_run_id()
    found = load_latest_checkpoint(
        cfg.checkpoint_dir,
        key=key,
        allow_fresh_start=cfg.checkpoint_allow_fresh_start,
        max_round=cfg.num_server_rounds,
    )
    if found is None:
        log(INFO, "fedddl: no checkpoint in %s, starting from round 0", cfg.checkpoint_dir)
        return None, new_run_id()
    path, ckpt = found
    if replica is None:
        raise ValueError(
            f"cannot resume {type(strategy).__name__} from {path}: only TernGrad-family "
            "strategies (a ReplicaStrategy) are checkpointed"
        )
    saved = dataclasses.replace(ckpt, config=_choices_resolved(ckpt.config))
    saved.check_config(
        _choices_resolved(cfg.to_run_config()),
        RESUME_CHECK_KEYS,
        _choices_resolved(AppConfig().to_run_config()),
    )
    replica.restore(ckpt)
    log(INFO, "fedddl: resumed from %s (round %d, version %d)", path, ckpt.round, ckpt.version)
    resumed = {"round": ckpt.round, "version": ckpt.version, "path": str(path)}
    return resumed, ckpt.run_id or new_run_id()


def _choices_resolved(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with ``downlink``, ``scale-bucket`` and ``bn-momentum`` as the run resolves
    them (``"auto"`` and the value it stands for compare equal on resume; a checkpoint older
    than the ``scale-bucket`` key ran with one scale per tensor, one older than ``"auto"``
    BatchNorm momenta with the model's own unless it says)."""
    out = dict(config)
    fraction = out.get("fraction-train", AppConfig.fraction_train)
    out.setdefault("bn-momentum", MODEL_OWN)
    if isinstance(fraction, (int, float)):
        with contextlib.suppress(ValueError):  # a bad value compares as saved
            out["bn-momentum"] = resolve_bn_momentum(
                out["bn-momentum"], fraction_train=float(fraction)
            )
    if isinstance(out.get("downlink"), str) and isinstance(fraction, (int, float)):
        out["downlink"] = resolve_downlink(
            out["downlink"],
            strategy=str(out.get("strategy", AppConfig.strategy)),
            fraction_train=float(fraction),
        )
    out.setdefault("scale-bucket", 0)
    compressor = out.get("compressor", AppConfig.compressor)
    downlink = out.get("downlink", AppConfig.downlink)
    if isinstance(compressor, str) and isinstance(downlink, str):
        with contextlib.suppress(ValueError):  # a bad or unknown value compares as saved
            out["scale-bucket"] = resolve_scale_bucket(
                out["scale-bucket"],
                downlink=downlink,
                compressor=compressor,
                compressor_takes_buckets=takes_scale_bucket(compressor),
            )
    return out


def _checkpoint_saver(
    replica: ReplicaStrategy, cfg: AppConfig, key: bytes | None, run_id: str, start: int
) -> Callable[[int], None]:
    """Return the ``on_round`` hook saving a checkpoint every ``cfg.checkpoint_every`` rounds
    (with ``key``: the high-water mark is written now, at round ``start``, and after each)."""
    from fedddl.checkpoint import save_checkpoint
    from fedddl.checkpoint_dir import checkpoint_path, prune_checkpoints
    from fedddl.checkpoint_mark import HighWaterMark, write_mark

    config = cfg.to_run_config()
    if key is not None:
        write_mark(cfg.checkpoint_dir, HighWaterMark(run_id, start), key)

    def save(global_round: int) -> None:
        if global_round % cfg.checkpoint_every:
            return
        ckpt = replica.checkpoint(global_round, config)
        ckpt.run_id = run_id
        path = save_checkpoint(ckpt, checkpoint_path(cfg.checkpoint_dir, global_round), key=key)
        if key is not None:
            write_mark(cfg.checkpoint_dir, HighWaterMark(run_id, global_round), key)
        prune_checkpoints(cfg.checkpoint_dir, cfg.checkpoint_keep)
        log(INFO, "fedddl: checkpoint of round %d written to %s", global_round, path)

    return save


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Return means of bytes and wall time per round, final accuracy and replica agreement."""
    rounds = result["rounds"]
    if not rounds:
        return {}
    n = len(rounds)
    checked = [r["replicas_equal"] for r in rounds if r["replicas_equal"] is not None]
    scored = [r["accuracy"] for r in rounds if r["accuracy"] is not None]
    return {
        "rounds": n,
        "final_accuracy": rounds[-1]["accuracy"],
        "best_accuracy": max(scored) if scored else None,
        "mean_bytes_up": sum(r["bytes_up"] for r in rounds) / n,
        "mean_bytes_down": sum(r["bytes_down"] for r in rounds) / n,
        "mean_wall_s": sum(r["wall_s"] for r in rounds) / n,
        "mean_wall_s_after_first": (
            sum(r["wall_s"] for r in rounds[1:]) / (n - 1) if n > 1 else rounds[0]["wall_s"]
        ),
        "replicas_equal_all": all(checked) if checked else None,
        "dropped_replies": sum(len(r.get("dropped", {})) for r in rounds),
        "clipped_replies": sum(len(r.get("clipped", {})) for r in rounds),
        "resync_limited": sum(len(r.get("resync_limited", [])) for r in rounds),
        "skipped_rounds": sum(1 for r in rounds if r.get("skipped")),
        **_attack_summary(result.get("attack"), rounds),
    }


def _attack_summary(attack: dict[str, Any] | None, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Attack evaluation: the figures of the honest nodes and of the attackers, apart."""
    if not attack:
        return {}
    n = len(rounds)
    bad = {str(node) for node in attack["node_ids"]}
    honest_checked = [r["replicas_equal_honest"] for r in rounds]
    checked = [v for v in honest_checked if v is not None]

    def split(key: str) -> tuple[int, int]:
        found = [node for r in rounds for node in r.get(key, {})]
        return sum(node in bad for node in found), sum(node not in bad for node in found)

    dropped_bad, dropped_honest = split("dropped")
    clipped_bad, clipped_honest = split("clipped")
    down_bad = sum(r["bytes_down_attackers"] for r in rounds) / n
    up_bad = sum(r["bytes_up_attackers"] for r in rounds) / n
    return {
        "replicas_equal_honest_all": all(checked) if checked else None,
        "mean_bytes_down_honest": sum(r["bytes_down"] for r in rounds) / n - down_bad,
        "mean_bytes_down_attackers": down_bad,
        "mean_bytes_up_honest": sum(r["bytes_up"] for r in rounds) / n - up_bad,
        "mean_bytes_up_attackers": up_bad,
        "dropped_attacker_replies": dropped_bad,
        "dropped_honest_replies": dropped_honest,
        "clipped_attacker_replies": clipped_bad,
        "clipped_honest_replies": clipped_honest,
    }


def make_server_app(
    cfg: AppConfig | None = None,
    sink: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ServerApp:
    """Build a ServerApp bound to ``cfg`` (None: read ``context.run_config``)."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        if cfg is None and context.run_config.get("strategy") == "gossip":
            # Gossip mode: the server only coordinates; models travel peer to peer.
            from strategies.gossip_coordinator import GossipConfig, run_gossip

            gossip = run_gossip(grid, context, GossipConfig.from_run_config(context.run_config))
            if sink is not None:
                sink(dataclasses.asdict(gossip))
            return
        run_cfg = cfg if cfg is not None else AppConfig.from_run_config(context.run_config)
        result = run_server(grid, run_cfg, progress)
        if sink is not None:
            sink(result)

    return server


app = make_server_app()
