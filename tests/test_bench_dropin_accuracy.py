"""``simulations/bench_dropin_accuracy.py``: variant specs, saved baselines, and one tiny run
of each kind."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from simulations.bench_dropin_accuracy import load_baselines, parse_variant, run_one
from tests.test_example_quickstart_compressed import needs_data


def test_variant_specs() -> None:
    assert parse_variant("plain") is None
    assert parse_variant("dropin") == {}
    assert parse_variant("dropin:downlink=false;downlink_steps=2;compressor=x") == {
        "downlink": False, "downlink_steps": 2, "compressor": "x"
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown variant"):
        parse_variant("fedavg")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_variant("dropin:downlink")


@needs_data
def test_plain_and_dropin_runs_replay_the_same_sampling_and_compress() -> None:
    args = argparse.Namespace(clients=4, samples=40, test_samples=200, fraction=0.5, lr=0.01,
                              rounds=3)  # fmt: skip
    plain = run_one("fedavg", "plain", seed=0, epochs=1, args=args)
    dropin = run_one("fedavg", "dropin:min_numel=100;downlink=delta", seed=0, epochs=1, args=args)
    assert [r["round"] for r in plain["rounds"]] == [0, 1, 2, 3]
    assert plain["rounds"][0]["accuracy"] == dropin["rounds"][0]["accuracy"]  # same start
    for p, d in zip(plain["rounds"][1:], dropin["rounds"][1:], strict=True):
        assert p["replies"] == d["replies"] == 2
        assert p["up"] > 10 * d["up"]  # ternary replies (biases dense: min_numel)
    assert dropin["rounds"][1]["gap"] == 0.0 < dropin["rounds"][2]["gap"]  # exact round 1
    assert dropin["dropped"] == {}


def test_saved_plain_runs_stand_in_for_the_plain_variant(tmp_path: Path) -> None:
    args = argparse.Namespace(clients=10, fraction=0.5, samples=1000, test_samples=2000,
                              lr=0.01, rounds=2)  # fmt: skip
    rounds = [{"round": r, "accuracy": r / 10} for r in range(4)]
    runs = [
        {"strategy": "fedavg", "epochs": 1, "seed": 0, "variant": "plain", "rounds": rounds},
        {"strategy": "fedavg", "epochs": 1, "seed": 0, "variant": "dropin", "rounds": rounds},
        {"strategy": "fedavg", "epochs": 1, "seed": 1, "variant": "plain", "rounds": rounds[:2]},
    ]
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"args": vars(args), "results": runs}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"args": {**vars(args), "samples": 500}, "results": runs}))
    found = load_baselines([str(other), str(same)], args)
    assert list(found) == [("fedavg", 1, 0)]  # seed 1 is too short; other settings skipped
    assert [r["round"] for r in found["fedavg", 1, 0]["rounds"]] == [0, 1, 2]
    assert found["fedavg", 1, 0]["baseline"] == str(same)
