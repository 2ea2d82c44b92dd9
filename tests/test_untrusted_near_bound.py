"""Attacks just under the bounds, end to end (in-process ``InlineGrid``, real ServerApp loop):
a client sending its negated gradient at 7.9x its scale (the bound is 8x), and a client
forging its BatchNorm statistics."""

from __future__ import annotations

import functools
from typing import Any

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.attacks import attacker_partitions
from fedddl.flower.inline_grid import InlineGrid
from strategies.server_app import run_server

NODES = 10
ROUNDS = 20


@functools.cache
def _run(attack: str = "", **settings: Any) -> dict[str, Any]:
    cfg = AppConfig(
        num_server_rounds=ROUNDS,
        min_available_nodes=NODES,
        partition="stratified",
        attack=attack,
        num_attackers=1 if attack else 0,
        **settings,
    )
    grid = InlineGrid(make_client_app(cfg), NODES, keep_sent=True)
    return run_server(grid, cfg, progress=lambda line: None)


def test_a_scale_just_under_the_bound_is_clipped_to_the_cap_every_round() -> None:
    # the cap alone: with the direction check (default) the attacker is dropped anyway, and
    # the norm clip (default) clips honest replies too
    capped = _run("near-bound:7.9", direction_check=0.0, norm_clip=0.0)
    uncapped = _run("near-bound:7.9", scale_weight=0.0, direction_check=0.0, norm_clip=0.0)
    bad = {str(1000 + p) for p in attacker_partitions(NODES, 1, 0)}
    for r in capped["rounds"]:
        assert set(r["clipped"]) >= bad and "the cap" in r["clipped"][min(bad)]
    assert capped["summary"]["clipped_honest_replies"] == 0
    assert capped["final_accuracy"] > uncapped["final_accuracy"] + 0.1, (
        capped["final_accuracy"],
        uncapped["final_accuracy"],
    )


def test_sign_vote_holds_one_near_bound_attacker_within_three_points_of_clean() -> None:
    clean = _run()
    voted = _run("near-bound:7.9", aggregator="sign-vote")
    assert voted["final_accuracy"] >= clean["final_accuracy"] - 0.03, (
        voted["final_accuracy"],
        clean["final_accuracy"],
    )


def test_the_default_drops_a_near_bound_attacker_every_round_within_three_points() -> None:
    clean = _run()
    attacked = _run("near-bound:7.9")
    bad = {str(1000 + p) for p in attacker_partitions(NODES, 1, 0)}
    for r in attacked["rounds"]:
        assert set(r["dropped"]) >= bad
        assert "direction opposes the round's majority" in r["dropped"][min(bad)]
    assert attacked["final_accuracy"] >= clean["final_accuracy"] - 0.03, (
        attacked["final_accuracy"],
        clean["final_accuracy"],
    )
    off = _run("near-bound:7.9", direction_check=0.0)
    assert attacked["final_accuracy"] > off["final_accuracy"] + 0.05, (
        attacked["final_accuracy"],
        off["final_accuracy"],
    )
