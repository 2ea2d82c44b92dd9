"""Tests of the discrete-event gossip simulator (real training on digits)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedddl.compression import IdentityCompressor, encode_update
from fedddl.gossip import GossipConfig, run_gossip
from fedddl.gossip.scheduler import PeerState
from fedddl.models import create_model
from fedddl.network import NetworkModel

FAST = {"nodes": 4, "dataset": "digits", "eval_interval_s": 1.0, "eval_samples": 200}


def _run(**overrides: Any) -> dict[str, Any]:
    return run_gossip({**FAST, **overrides})


@pytest.fixture(scope="module")
def slow_net(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 nodes, 0.3 s latency, 100 kB/s: a model message takes ~0.5 s, a step 0.05 s."""
    net = NetworkModel.homogeneous(4, latency_s=0.3, bandwidth_Bps=1e5)
    path = tmp_path_factory.mktemp("net") / "slow.json"
    path.write_text(json.dumps(net.to_dict()))
    return str(path)


@pytest.fixture(scope="module")
def random_run() -> dict[str, Any]:
    return _run(scheduler="random", max_virtual_time_s=6.0, seed=3)


def test_accuracy_rises(random_run: dict[str, Any]) -> None:
    curve = random_run["curve"]
    assert curve[0][0] == 0.0 and curve[-1][0] == pytest.approx(6.0)
    assert [t for t, _ in curve] == sorted(t for t, _ in curve)
    assert curve[0][1] < 0.3
    assert random_run["final_accuracy"] > max(0.6, curve[0][1] + 0.4)
    assert random_run["final_accuracy"] == curve[-1][1]


def test_deterministic_for_a_seed(random_run: dict[str, Any]) -> None:
    again = _run(scheduler="random", max_virtual_time_s=6.0, seed=3)
    for key in ("curve", "messages", "bytes_total", "stale_merges", "steps_per_node"):
        assert again[key] == random_run[key]
    other = _run(scheduler="random", max_virtual_time_s=6.0, seed=4)
    assert other["curve"] != random_run["curve"]


def test_scheduled_is_deterministic_too() -> None:
    a = _run(scheduler="scheduled", network="heterogeneous", max_virtual_time_s=3.0)
    b = _run(scheduler="scheduled", network="heterogeneous", max_virtual_time_s=3.0)
    assert a["curve"] == b["curve"] and a["bytes_total"] == b["bytes_total"]


def test_bytes_are_messages_times_real_serialized_size(random_run: dict[str, Any]) -> None:
    state = create_model("digits", seed=3).state_dict()
    size = len(encode_update(state, IdentityCompressor()))
    assert random_run["model_bytes"] == size
    assert random_run["messages"] > 0
    assert random_run["bytes_total"] == random_run["messages"] * size
    assert random_run["status_bytes_total"] == 0


def test_scheduled_counts_status_bytes() -> None:
    result = _run(scheduler="scheduled", max_virtual_time_s=3.0)
    model_total = result["messages"] * result["model_bytes"]
    assert result["bytes_total"] == model_total + result["status_bytes_total"]
    # every status message has the header and at most one estimate per other node
    smallest, largest = PeerState.message_size(0), PeerState.message_size(3)
    assert smallest * result["status_messages"] <= result["status_bytes_total"]
    assert result["status_bytes_total"] <= largest * result["status_messages"]
    # one initial broadcast per node, then at least two per node that received anything
    assert result["status_messages"] >= 3 * (4 + 2 * 1)


def test_overlap_computes_while_sending(slow_net: str) -> None:
    common = {"scheduler": "random", "network": slow_net, "max_virtual_time_s": 4.0}
    blocking = _run(overlap=False, **common)
    overlapping = _run(overlap=True, **common)
    # overlapping: 4 nodes x 4 s / 0.05 s = 320 steps; blocking waits ~0.5 s per send
    assert overlapping["steps_total"] == 4 * 80
    assert blocking["steps_total"] < overlapping["steps_total"] / 4
    # with overlap a node sends only when its uplink is free: at most ~1 per 0.5 s
    assert overlapping["messages"] <= 4 * 4 / 0.49


def test_stale_merges_follow_the_threshold(slow_net: str) -> None:
    common = {"scheduler": "random", "network": slow_net, "overlap": True, "max_virtual_time_s": 3}
    strict = _run(stale_threshold_steps=2, **common)
    lax = _run(stale_threshold_steps=1000, **common)
    assert strict["messages"] > 0
    # a 0.5 s transfer lets the receiver advance ~10 steps past the snapshot
    assert strict["stale_merges"] == strict["messages"]
    assert lax["stale_merges"] == 0


def test_scheduled_beats_random_on_heterogeneous_digits() -> None:
    common = {"network": "heterogeneous", "nodes": 8, "max_virtual_time_s": 3.0}
    random_ = _run(scheduler="random", **common)
    scheduled = _run(scheduler="scheduled", **common)
    assert scheduled["steps_total"] > random_["steps_total"]
    assert scheduled["curve"][3][1] > random_["curve"][3][1]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown gossip config keys: \\['nodez'\\]"):
        GossipConfig.from_mapping({"nodez": 3})
    with pytest.raises(ValueError, match="scheduler"):
        GossipConfig(scheduler="fifo")
    with pytest.raises(ValueError, match="compute_time_s"):
        GossipConfig(compute_time_s=0.0)
    assert GossipConfig(scheduler="random").overlaps is False
    assert GossipConfig(scheduler="scheduled").overlaps is True
    assert GossipConfig(scheduler="random", overlap=True).overlaps is True


def test_network_size_mismatch_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "n3.json"
    path.write_text(json.dumps(NetworkModel.homogeneous(3).to_dict()))
    with pytest.raises(ValueError, match="describes 3 nodes, but 4"):
        _run(network=str(path), max_virtual_time_s=1.0)


def test_compressed_gossip_learns_with_a_tenth_of_the_bytes() -> None:
    common = {"scheduler": "scheduled", "network": "heterogeneous", "nodes": 8,
              "max_virtual_time_s": 4.0, "seed": 1}
    plain = _run(**common)
    compressed = _run(compressor="ternary-base3", **common)
    assert compressed["compressor"] == "ternary-base3" and compressed["key_frames"] == 0
    # Messages are the real encoded differences (ternary base-3 codes, plus 4 bytes per gain).
    assert compressed["message_bytes_mean"] < plain["model_bytes"] / 12
    assert compressed["model_bytes_total"] * 10 < plain["model_bytes_total"]
    assert compressed["bytes_total"] == (
        compressed["model_bytes_total"] + compressed["status_bytes_total"])
    assert compressed["final_accuracy"] > max(0.7, plain["final_accuracy"] - 0.05)
    again = _run(compressor="ternary-base3", **common)
    assert again["curve"] == compressed["curve"]
    assert again["bytes_total"] == compressed["bytes_total"]


def test_compressed_messages_take_their_own_transfer_time(slow_net: str) -> None:
    common = {"scheduler": "random", "network": slow_net, "overlap": True,
              "max_virtual_time_s": 4.0}
    plain = _run(**common)
    compressed = _run(compressor="ternary-base3", **common)
    # fp32: 0.3 s + 19.4 kB / 100 kB/s = 0.49 s per message; compressed: 0.3 s + 1.1 kB
    # / 100 kB/s = 0.31 s, so a node's uplink is free again sooner and it sends more often.
    assert plain["messages"] <= 4 * 4 / 0.49
    assert compressed["messages"] >= 1.4 * plain["messages"]


@pytest.mark.parametrize("compressor", [None, "ternary-base3"])
def test_a_batchnorm_model_is_simulated_and_its_integer_buffer_counted(
        compressor: str | None) -> None:
    arch = "tests.support.models:tiny_bn"
    result = _run(scheduler="scheduled", max_virtual_time_s=3.0, arch=arch,
                  **({"compressor": compressor} if compressor else {}))
    state = create_model("digits", seed=0, arch=arch).state_dict()
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    # the peers' MODEL frames carry num_batches_tracked raw (8 bytes), next to the floats
    assert result["model_bytes"] == len(encode_update(floats, IdentityCompressor())) + 8
    assert result["messages"] > 0 and result["final_accuracy"] > 0.2
