"""One compromised peer of 8 (valid identity, in-bound poison) in the gossip simulator.

Without the clip the honest nodes fall to chance; with the default clip they end
within 5 points of the clean run of the same seed.
"""

from __future__ import annotations

from typing import Any

import pytest

from fedddl.gossip.sim_config import GossipConfig
from fedddl.gossip.simulator import run_gossip

EIGHT = {"nodes": 8, "dataset": "digits", "max_virtual_time_s": 12.0, "eval_interval_s": 4.0,
         "seed": 0}


def _run(**overrides: Any) -> dict[str, Any]:
    return run_gossip({**EIGHT, **overrides})


def _check(clean: dict[str, Any], attacked: dict[str, Any], unclipped: dict[str, Any]) -> None:
    assert clean["final_accuracy"] > 0.85
    assert unclipped["final_accuracy"] < clean["final_accuracy"] - 0.3  # the attack works
    assert attacked["final_accuracy"] >= clean["final_accuracy"] - 0.05
    assert attacked["attackers"] == [7] and clean["attackers"] == []
    # Every frame of the attacker to its 7 honest peers is clipped, as an outlier.
    assert sum(attacked["clipped"]["node 7"].values()) > 0
    assert attacked["clipped"]["node 7"].get("clip-far", 0) >= 0.9 * sum(
        attacked["clipped"]["node 7"].values()
    )


def test_one_poisoning_peer_of_8_costs_at_most_5_points() -> None:
    clean = _run()
    attacked = _run(attack="constant", attackers=1)
    unclipped = _run(attack="constant", attackers=1, clip=0.0)
    _check(clean, attacked, unclipped)


@pytest.mark.slow
def test_one_poisoning_peer_of_8_costs_at_most_5_points_compressed() -> None:
    common = {"compressor": "ternary-base3"}
    clean = _run(**common)
    attacked = _run(attack="scaled-initial", attackers=1, **common)
    unclipped = _run(attack="scaled-initial", attackers=1, clip=0.0, **common)
    _check(clean, attacked, unclipped)


def test_attack_config_is_checked() -> None:
    with pytest.raises(ValueError, match="attack"):
        GossipConfig(attack="nope", attackers=1)
    with pytest.raises(ValueError, match="go together"):
        GossipConfig(attack="constant", attackers=0)
    with pytest.raises(ValueError, match="attackers"):
        GossipConfig(nodes=4, attack="constant", attackers=4)
    with pytest.raises(ValueError, match="clip"):
        GossipConfig(clip=-1.0)


def test_cli_and_peer_defaults_match_the_library() -> None:
    from fedddl.cli import build_parser
    from fedddl.gossip.attack import GOSSIP_ATTACKS
    from fedddl.gossip.clip import DEFAULT_CLIP
    from fedddl.gossip.peer import build_parser as peer_parser
    from fedddl.gossip.peer_launcher import PEER_OPTIONS

    args = build_parser().parse_args(["gossip"])
    assert args.clip == DEFAULT_CLIP == GossipConfig().clip
    assert peer_parser().parse_args(["--node-id", "0", "--num-nodes", "2"]).clip == DEFAULT_CLIP
    assert PEER_OPTIONS["clip"] is float and "attack" not in PEER_OPTIONS
    for kind in GOSSIP_ATTACKS:
        parsed = build_parser().parse_args(["gossip", "--attack", kind])
        assert parsed.attack == kind and parsed.attackers is None
