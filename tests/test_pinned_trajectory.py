"""Pinned TernGrad trajectories: the Flower-layer refactor must not change behaviour.

Each scenario runs the real ServerApp loop (``run_server``) and ClientApp on the
in-process grid, 10 digits clients, 20 rounds, and records per round the bytes each
way, the fingerprints every client reported and the server's accuracy, plus the final
shadow fingerprint. The values in ``tests/data/pinned_trajectories.json`` were recorded
before the Flower layer was reorganised; this test passes unchanged after it.

Regenerate (only for a deliberate behaviour change, and say so in the commit)::

    python -m tests.test_pinned_trajectory --record

Float results depend on the CPU (vendor and vector instructions: the same AVX-512 build of
torch gives other last bits on AMD than on Intel) and the torch build. The file holds one
recording per environment (``cpu_vendor``, ``torch.backends.cpu.get_cpu_capability()``,
torch version); on a machine that matches none of them the test is skipped with that
reason. ``--record`` adds (or replaces) this machine's recording.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Message

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.flower.inline_grid import InlineGrid
from strategies.server_app import run_server

PINNED = Path(__file__).parent / "data" / "pinned_trajectories.json"
NODES = 10

SCENARIOS: dict[str, dict[str, Any]] = {
    "reternarize": {"downlink": "reternarize"},
    "shared-scale-sum": {"downlink": "shared-scale-sum"},
    "partial-reternarize": {"downlink": "reternarize", "fraction-train": 0.5, "update-log-size": 2},
    "partial-shared-scale-sum": {
        "downlink": "shared-scale-sum",
        "fraction-train": 0.6,
        "update-log-size": 3,
    },
    "error-feedback": {"downlink": "reternarize", "error-feedback": True},
    "gradient-average": {"strategy": "gradient-average", "fraction-train": 0.7},
}


def _cpu_vendor() -> str:
    """The CPU vendor id (``GenuineIntel``, ``AuthenticAMD``; else the machine type)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _environment() -> dict[str, str]:
    return {
        "torch": torch.__version__.split("+")[0],
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "cpu_vendor": _cpu_vendor(),
    }


def run_scenario(name: str) -> dict[str, Any]:
    """Run one scenario and return what is pinned."""
    torch.set_num_threads(1)
    base = {"num-server-rounds": 20, "seed": 0, "min-available-nodes": NODES}
    cfg = AppConfig.from_run_config({**base, "fp32-logits": False, **SCENARIOS[name]})
    reported: dict[int, list[str]] = {}
    catch_up: dict[int, list[str]] = {}

    def tamper(message: Message, reply: Message) -> Message:
        content = message.content
        server_round = int(content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        kind = "snapshot" if "snapshot" in content.array_records else (
            f"log:{len(content.array_records['updates'])}"
            if "updates" in content.array_records
            else "none"
        )
        catch_up.setdefault(server_round, []).append(kind)
        if not reply.has_error():
            replica = reply.content.config_records.get("replica")
            if replica is not None:
                fp = replica.get("fingerprint")
                assert isinstance(fp, bytes)
                reported.setdefault(server_round, []).append(fp.hex())
        return reply

    grid = InlineGrid(make_client_app(cfg), NODES, tamper=tamper)
    result = run_server(grid, cfg, progress=lambda line: None)
    return {
        "rounds": [
            {
                "bytes_up": r["bytes_up"],
                "bytes_down": r["bytes_down"],
                "accuracy": r["accuracy"],
                "replicas_equal": r["replicas_equal"],
                "fingerprints": sorted(reported.get(r["round"], [])),
                "catch_up": sorted(catch_up.get(r["round"], [])),
            }
            for r in result["rounds"]
        ],
        "final_version": result["final_version"],
        "final_fingerprint": result["final_fingerprint"],
    }


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    recordings: list[dict[str, Any]] = json.loads(PINNED.read_text())["recordings"]
    here = _environment()
    for data in recordings:
        if data["environment"] == here:
            return data
    pinned_on = [data["environment"] for data in recordings]
    pytest.skip(f"pinned on {pinned_on}, this machine is {here}")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_trajectory_matches_pinned(name: str, pinned: dict[str, Any]) -> None:
    got = run_scenario(name)
    want = pinned["scenarios"][name]
    assert got["final_version"] == want["final_version"]
    for i, (g, w) in enumerate(zip(got["rounds"], want["rounds"], strict=True), start=1):
        assert g == w, f"{name}: round {i} differs"
    assert got["final_fingerprint"] == want["final_fingerprint"]


def test_pinned_scenarios_exercise_catch_up(pinned: dict[str, Any]) -> None:
    """The partial scenarios sample subsets and catch up both by log replay and by snapshot."""
    for name in ("partial-reternarize", "partial-shared-scale-sum"):
        rounds = pinned["scenarios"][name]["rounds"]
        assert max(len(r["fingerprints"]) for r in rounds) < NODES
        kinds = {k.split(":")[0] for r in rounds[1:] for k in r["catch_up"]}
        assert {"log", "snapshot"} <= kinds, kinds


def _record() -> None:
    data = {
        "environment": _environment(),
        "scenarios": {name: run_scenario(name) for name in sorted(SCENARIOS)},
    }
    recordings = json.loads(PINNED.read_text())["recordings"] if PINNED.exists() else []
    others = [r for r in recordings if r["environment"] != data["environment"]]
    PINNED.write_text(json.dumps({"recordings": [*others, data]}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_pinned_trajectory --record")
    _record()
