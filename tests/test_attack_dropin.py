"""simulations/attack_dropin.py and the ``--path dropin`` / ``--path gossip`` rows of
simulations/attack_table.py, on tiny configurations: the attacker's replies are forged,
the drop-in wrapper drops them with a reason and the server never raises."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.serverapp.strategy import FedAvg, FedMedian

from simulations import attack_dropin, attack_table

ROUNDS, CLIENTS = 2, 4


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("attack", ["scale:1e6", "nan-plain"])
def test_an_attack_the_admission_refuses_is_dropped_every_round(attack: str) -> None:
    result = attack_dropin.run_dropin(attack, "fedavg", rounds=ROUNDS, clients=CLIENTS)
    assert result["raised"] is None and result["final_accuracy"] is not None
    assert result["tampered"] == ROUNDS and result["untouched"] == 0
    assert result["dropped"] == {"PayloadRejected": ROUNDS}
    assert not result["skipped"] and result["attacker_node"] >= 1000


def test_the_near_bound_attack_is_forged_and_the_server_does_not_raise() -> None:
    result = attack_dropin.run_dropin("near-bound:7.9", "fedmedian", rounds=ROUNDS,
                                      clients=CLIENTS)  # fmt: skip
    assert result["raised"] is None and result["tampered"] == ROUNDS
    assert 0.0 <= result["final_accuracy"] <= 1.0
    assert isinstance(attack_dropin.DropinStrategy.built[-1].strategy, FedMedian)


def test_a_clean_run_forges_and_drops_nothing() -> None:
    result = attack_dropin.run_dropin("", "fedavg", rounds=ROUNDS, clients=CLIENTS)
    assert result["attacker_node"] is None and result["tampered"] == 0
    assert result["dropped"] == {} and result["raised"] is None
    built = attack_dropin.DropinStrategy.built[-1].strategy
    assert type(built) is FedAvg


def test_the_server_raising_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    import strategies.server_app

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("tensor has NaN or Inf values")

    monkeypatch.setattr(strategies.server_app, "run_server", boom)
    result = attack_dropin.run_dropin("scale:1e6", "fedavg", rounds=ROUNDS, clients=CLIENTS)
    assert result["raised"] == "ValueError: tensor has NaN or Inf values"
    assert result["final_accuracy"] is None
    assert "ValueError" in attack_dropin.table([result])


def test_the_table_path_caches_each_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = attack_table.dropin_results(ROUNDS, tmp_path, ["scale:1e6"], ("fedavg",), CLIENTS)
    assert len(rows) == 1 and rows[0]["raised"] is None
    (path,) = tmp_path.glob("dropin-fedavg-scale_1e6-*.json")
    assert json.loads(path.read_text())["dropped"] == {"PayloadRejected": ROUNDS}

    def fail(*args: Any) -> Any:
        raise AssertionError("a cached row was run again")

    monkeypatch.setattr(attack_dropin, "run_dropin", fail)
    again = attack_table.dropin_results(ROUNDS, tmp_path, ["scale:1e6"], ("fedavg",), CLIENTS)
    assert again == rows
    text = attack_table.dropin_table(again, ROUNDS)
    assert "| TernaryDelta(fedavg) | scale:1e6 |" in text and "| never |" in text


def test_the_gossip_path_runs_every_attack_with_and_without_the_clip(tmp_path: Path) -> None:
    from simulations.gossip_compromised import table

    rows = attack_table.gossip_results(tmp_path, seconds=1.0, compressors=("",))
    assert len(rows) == 2 * len(attack_table.GOSSIP_ATTACKS)
    assert {(r["attack"], r["clip"] > 0) for r in rows} == {
        (a or "clean", on) for a in attack_table.GOSSIP_ATTACKS for on in (False, True)
    }
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert len(list(tmp_path.glob("gossip-*.json"))) == len(rows)
    assert len(table(rows).splitlines()) == 2 + len(rows)


def test_the_direction_check_drops_every_near_bound_reply_the_scale_bound_lets_through() -> None:
    on = attack_dropin.run_dropin("near-bound:7.9", "fedavg", rounds=3, clients=5)
    assert on["raised"] is None and on["tampered"] == 3
    assert sum(on["dropped"].values()) == 3, on["dropped"]  # every forged reply
    assert on["dropped"].get("OpposedDirection", 0) >= 1, on["dropped"]
