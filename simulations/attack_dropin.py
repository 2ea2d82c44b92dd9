"""One malicious client against the drop-in layer: ``TernaryDelta(FedAvg | FedMedian)``.

The project's digits client app behind :func:`~fedddl.flower.ternary_mod`
(:func:`simulations.ternary_delta_app.make_delta_client_app`) on the inline engine
(:class:`~fedddl.flower.inline_grid.InlineGrid`), one client of ``clients`` (the partition
:func:`~fedddl.attacks.attacker_partitions` picks from the seed) rewriting every train reply
after its mod, so each message stays well-formed:

===================  =====================================================================
attack               the attacker's train reply
===================  =====================================================================
``scale:S``          its encoded delta with every scale ``× S``
                     (:func:`fedddl.attacks.rewrite_payload`)
``near-bound:F``     its encoded delta negated, every scale ``× F``
``nan-plain``        a plain reply (no mod records): the model's layout, every float NaN
===================  =====================================================================

:func:`run_dropin` returns the run's final accuracy, what the wrapper dropped, clipped and
skipped, and the server's exception if it raised (``None``: it never did).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg, FedMedian
from torch import nn

from fedddl.app_config import AppConfig
from fedddl.attacks import attacker_partitions, parse_attack
from fedddl.attacks.tamper import rewrite_payload
from fedddl.flower import TernaryDelta
from fedddl.flower.delta_protocol import DELTA, DELTA_KEY, META
from fedddl.flower.inline_grid import FIRST_NODE_ID, InlineGrid
from fedddl.flower.records import array_to_bytes, bytes_to_array

__all__ = ["ATTACKS", "WRAPPED", "DropinStrategy", "run_dropin", "table"]

#: The attacks of the drop-in rows ('' is the clean run).
ATTACKS = ("", "scale:1e6", "nan-plain", "near-bound:7.9")


class DropinStrategy(TernaryDelta):
    """``TernaryDelta`` around a stock Flower strategy (:attr:`INNER`), built by name from
    an AppConfig; every instance built is kept in :attr:`built` (for its counters)."""

    INNER: ClassVar[type[FedAvg]] = FedAvg
    built: ClassVar[list[TernaryDelta]] = []

    @classmethod
    def from_app_config(cls, cfg: AppConfig, model_fn: Callable[[], nn.Module]) -> DropinStrategy:
        """``INNER`` with ``cfg``'s fraction and nodes (no client evaluation), wrapped."""
        inner = cls.INNER(
            fraction_train=cfg.fraction_train, fraction_evaluate=0.0, min_train_nodes=1,
            min_evaluate_nodes=0, min_available_nodes=cfg.min_available_nodes,
        )  # fmt: skip
        strategy = cls(inner, seed=cfg.seed)
        DropinStrategy.built.append(strategy)
        return strategy


class DropinFedMedian(DropinStrategy):
    """:class:`DropinStrategy` around Flower's ``FedMedian``."""

    INNER = FedMedian


#: Wrapped strategy name -> the ``strategy`` of its AppConfig.
WRAPPED = {
    "fedavg": "simulations.attack_dropin:DropinStrategy",
    "fedmedian": "simulations.attack_dropin:DropinFedMedian",
}


def _nan_state(model_fn: Callable[[], nn.Module]) -> ArrayRecord:
    state = model_fn().state_dict()
    return ArrayRecord({k: torch.full_like(v, math.nan) if v.is_floating_point() else v
                        for k, v in state.items()})  # fmt: skip


def attacker_tamper(
    attack: str, node: int, model_fn: Callable[[], nn.Module], counts: dict[str, int]
) -> Callable[[Message, Message], Message]:
    """The :class:`InlineGrid` ``tamper`` of node ``node`` running ``attack``; ``counts``
    gets ``"tampered"`` (replies rewritten) and ``"untouched"`` (train replies left as they
    were: an error, or no encoded delta for a payload attack)."""
    parsed = None if attack == "nan-plain" else parse_attack(attack)

    def tamper(message: Message, reply: Message) -> Message:
        if message.metadata.dst_node_id != node or message.metadata.message_type != "train":
            return reply
        content = reply.content if not reply.has_error() else None
        if content is not None and parsed is None:
            for key in (META, DELTA):
                if key in content:
                    del content[key]
            content["arrays"] = _nan_state(model_fn)
        elif content is not None and DELTA in content:
            assert parsed is not None
            data = array_to_bytes(content[DELTA][DELTA_KEY])  # type: ignore[index, arg-type]
            forged = rewrite_payload(data, parsed)
            content[DELTA] = ArrayRecord({DELTA_KEY: bytes_to_array(forged)})  # type: ignore[arg-type]
        else:
            counts["untouched"] = counts.get("untouched", 0) + 1
            return reply
        counts["tampered"] = counts.get("tampered", 0) + 1
        return reply

    return tamper


def run_dropin(
    attack: str, wrapped: str = "fedavg", rounds: int = 30, clients: int = 10, seed: int = 0
) -> dict[str, Any]:
    """One digits run of ``TernaryDelta(wrapped)`` with one attacker (``attack`` '': none).

    Returns ``{"attack", "wrapped", "rounds", "clients", "attacker_node",
    "final_accuracy", "dropped", "clipped", "skipped", "tampered", "untouched", "raised",
    "runtime_s"}``; ``raised``: the server's exception as text, None if it never raised
    (then ``final_accuracy`` is None).
    """
    from simulations.ternary_delta_app import make_delta_client_app
    from strategies.server_app import run_server

    cfg = AppConfig(
        dataset="digits", strategy=WRAPPED[wrapped], num_server_rounds=rounds,
        min_available_nodes=clients, eval_every=rounds, seed=seed,
    )  # fmt: skip
    node = None
    counts: dict[str, int] = {}
    tamper = None
    if attack:
        node = FIRST_NODE_ID + attacker_partitions(clients, 1, seed)[0]
        tamper = attacker_tamper(attack, node, cfg.model_factory(), counts)
    grid = InlineGrid(make_delta_client_app(cfg), clients, tamper=tamper)
    DropinStrategy.built.clear()
    start = time.perf_counter()
    raised = None
    accuracy = None
    try:
        accuracy = run_server(grid, cfg, progress=lambda _: None)["final_accuracy"]
    except Exception as err:  # the figure this run reports: the server must never raise
        raised = f"{type(err).__name__}: {err}"
    strategy = DropinStrategy.built[-1] if DropinStrategy.built else None
    return {
        "attack": attack, "wrapped": wrapped, "rounds": rounds, "clients": clients,
        "attacker_node": node, "final_accuracy": accuracy,
        "dropped": dict(strategy.dropped) if strategy else {},
        "clipped": {str(k): v for k, v in strategy.clipped.items()} if strategy else {},
        "skipped": list(strategy.skipped) if strategy else [],
        "tampered": counts.get("tampered", 0), "untouched": counts.get("untouched", 0),
        "raised": raised, "runtime_s": time.perf_counter() - start,
    }  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    """The Markdown table of :func:`run_dropin` results."""
    lines = [
        "| wrapped | attack | accuracy % | replies forged | dropped | clipped | rounds skipped "
        "| server raised | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        accuracy = "—" if r["final_accuracy"] is None else f"{100 * r['final_accuracy']:.2f}"
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(r["dropped"].items())) or "0"
        clipped = sum(r["clipped"].values())
        lines.append(
            f"| TernaryDelta({r['wrapped']}) | {r['attack'] or 'none'} | {accuracy} "
            f"| {r['tampered']} | {dropped} | {clipped} | {len(r['skipped'])} "
            f"| {r['raised'] or 'never'} | {r['runtime_s']:.1f} |"
        )
    return "\n".join(lines)
