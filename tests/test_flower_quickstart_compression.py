"""fedddl's ternary compression added to a Flower-quickstart-style app, in Flower's
simulation (Ray): the same FedAvg run with and without ``ternary_mod`` + ``TernaryDelta``.

Checked: accuracy of the global model at most 1 point below after the same rounds, and the
serialized bytes of every message (``CountingGrid``): at least 12x fewer up in every
round, and down in every round after the first (which carries the whole model).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.quickstart_app import make_client_app, make_server_app

pytestmark = pytest.mark.slow

ROUNDS = 30
NODES = 5


def _simulate(compressed: bool) -> dict[str, Any]:
    import ray
    from flwr.simulation import run_simulation

    from fedddl.flower.simulation import ray_failed_to_start

    for attempt in (1, 2):  # Ray's node start times out now and then on a loaded machine
        results: list[dict[str, Any]] = []
        try:
            run_simulation(
                server_app=make_server_app(
                    compressed=compressed, num_rounds=ROUNDS, sink=results.append
                ),
                client_app=make_client_app(compressed=compressed),
                num_supernodes=NODES,
                backend_config={
                    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                    "init_args": {"logging_level": "warning", "log_to_driver": True},
                },
            )
            break
        except RuntimeError as error:
            if attempt == 2 or not ray_failed_to_start(error):
                raise
            ray.shutdown()
    assert results, "the ServerApp did not finish"
    return results[0]


def _per_round(exchanges: list[dict[str, Any]], key: str) -> list[int]:
    """Bytes of each round (its train and evaluate exchanges)."""
    rounds = []
    for i in range(0, len(exchanges), 2):
        rounds.append(sum(e[key] for e in exchanges[i : i + 2]))
    return rounds


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict[str, Any]]:
    os.environ.setdefault("FLWR_HOME", str(tmp_path_factory.mktemp("flwr_home")))
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    return {compressed: _simulate(compressed) for compressed in (False, True)}


def test_no_accuracy_lost_after_the_same_rounds(
    runs: dict[bool, dict[str, Any]],
) -> None:
    """Compressed ends at most 1 point below plain (the claim is no loss of accuracy; on an
    AMD EPYC it ended 1.3 points above, on an Intel Xeon within 1 point either way)."""
    plain, ternary = runs[False]["accuracy"], runs[True]["accuracy"]
    assert len(plain) == len(ternary) == ROUNDS + 1  # round 0 and every round
    assert plain[-1] > 0.85, plain  # the run learned something worth comparing
    assert ternary[-1] >= plain[-1] - 0.01, (plain[-1], ternary[-1])


def test_bytes_up_and_down_at_least_12x_fewer(runs: dict[bool, dict[str, Any]]) -> None:
    plain, ternary = runs[False]["exchanges"], runs[True]["exchanges"]
    assert [e["type"] for e in plain] == [e["type"] for e in ternary]
    assert all(e["replies"] > 0 for e in plain + ternary)
    up_plain, up_ternary = _per_round(plain, "up"), _per_round(ternary, "up")
    down_plain, down_ternary = _per_round(plain, "down"), _per_round(ternary, "down")
    up = [p / t for p, t in zip(up_plain, up_ternary, strict=True)]
    down = [p / t for p, t in zip(down_plain, down_ternary, strict=True)]
    print(
        f"\nquickstart, {NODES} clients, {ROUNDS} rounds: accuracy "
        f"{runs[False]['accuracy'][-1]:.4f} plain / {runs[True]['accuracy'][-1]:.4f} ternary; "
        f"bytes/round up {up_plain[-1]} / {up_ternary[-1]} ({min(up):.1f}-{max(up):.1f}x), "
        f"down round 1 {down_plain[0]} / {down_ternary[0]}, later {down_plain[-1]} / "
        f"{down_ternary[-1]} ({min(down[1:]):.1f}-{max(down[1:]):.1f}x)"
    )
    assert min(up) >= 12, up
    assert min(down[1:]) >= 12, down  # round 1 carries the whole model
    assert down[0] < 1.5, down  # ... at about the uncompressed size
    # nothing dropped but the honest replies the direction check judges opposed (late in
    # training honest gradients disagree; the accuracy test above holds with them)
    dropped = runs[True]["strategy"].dropped
    assert set(dropped) <= {"OpposedDirection"}, dropped
    assert sum(dropped.values()) <= 0.1 * ROUNDS * NODES, dropped  # 9 of 150 measured


def test_docs_report_these_figures() -> None:
    """The drop-in compression page and the README's results row name this test as the source."""
    root = Path(__file__).resolve().parents[1]
    for page in ("docs/drop-in-compression.md", "README.md"):
        assert "tests/test_flower_quickstart_compression.py" in (root / page).read_text(), page
