"""Pinned TernGrad trajectories: refactors must not change behaviour.

Each scenario runs the real ServerApp loop (``run_server``) and ClientApp on the
in-process grid, 10 digits clients, 20 rounds, and is compared with two references:

* **Portable** (``tests/data/pinned_portable.json``, checked on every machine): per round,
  exactly, what does not depend on float rounding -- the bytes and messages each way, the
  catch-up each client was sent, replies accepted, dropped and clipped, model version,
  downlink format, whether the replicas agree, how many clients reported a replica; and,
  within a tolerance, the float results -- server accuracy and loss, mean training loss.
* **Exact** (``tests/data/pinned_trajectories.json``, one recording per environment):
  the bytes, accuracy, catch-up and every replica fingerprint of every round, bit for bit.
  Float last bits depend on the CPU (vendor and vector instructions) and the torch build,
  so this check runs only where a recording's ``environment`` matches this machine.

``tests/test_pinned_wire.py`` pins the uplink encoder's bytes exactly on every machine.

Regenerate (only for a deliberate behaviour change, and say so in the commit)::

    python -m tests.test_pinned_trajectory --record

``--record`` rewrites the portable reference and adds (or replaces) this machine's exact
recording; the exact recordings of other environments stay as they are. After a deliberate
change, delete the changed scenarios from the recordings of environments you cannot rerun:
an environment's recording may cover fewer scenarios than the portable reference (its exact
check skips the others), and at least one recording covers every scenario.
"""

from __future__ import annotations

import functools
import json
import math
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

DATA = Path(__file__).parent / "data"
PINNED = DATA / "pinned_trajectories.json"
PORTABLE = DATA / "pinned_portable.json"
NODES = 10

SCENARIOS: dict[str, dict[str, Any]] = {
    "reternarize": {"downlink": "reternarize"},
    "reternarize-per-tensor": {"downlink": "reternarize", "scale-bucket": 0},
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

# Per-round fields of the portable reference compared exactly: none depends on float
# rounding (message sizes follow from the model, codecs and catch-up plan; the plan from
# the seeded client sampling and the log size).
EXACT = (
    "bytes_up",
    "bytes_down",
    "messages_up",
    "messages_down",
    "catch_up",
    "reporters",
    "accepted",
    "dropped",
    "clipped",
    "model_version",
    "downlink_format",
    "replicas_equal",
)
# Per-round float fields of the portable reference: (absolute, relative) tolerance.
# Other vector kernels (AVX-512, AVX2, none) move the losses by about 1e-7 relative and
# leave every ternary code as it was; the bounds leave room for a rare flipped code.
# Accuracy is over 450 test images: 0.01 is 4 images.
TOLERANCE: dict[str, tuple[float, float]] = {
    "accuracy": (0.01, 0.0),
    "loss": (0.0, 1e-4),
    "train_loss": (0.0, 1e-4),
}
# Per-round fields of an exact (per-environment) recording.
STRICT = ("bytes_up", "bytes_down", "accuracy", "replicas_equal", "fingerprints", "catch_up")


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


@functools.cache
def run_scenario(name: str) -> dict[str, Any]:
    """Run one scenario (once per process) and return every pinned field."""
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
    rounds = []
    for r in result["rounds"]:
        fingerprints = sorted(reported.get(r["round"], []))
        rounds.append(
            {
                **{key: r[key] for key in EXACT if key in r},
                **{key: r[key] for key in TOLERANCE},
                "fingerprints": fingerprints,
                "reporters": len(fingerprints),
                "catch_up": sorted(catch_up.get(r["round"], [])),
            }
        )
    return {
        "rounds": rounds,
        "final_version": result["final_version"],
        "final_fingerprint": result["final_fingerprint"],
    }


def _portable(run: dict[str, Any]) -> dict[str, Any]:
    keys = (*EXACT, *TOLERANCE)
    return {
        "rounds": [{key: r[key] for key in keys} for r in run["rounds"]],
        "final_version": run["final_version"],
    }


def _strict(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "rounds": [{key: r[key] for key in STRICT} for r in run["rounds"]],
        "final_version": run["final_version"],
        "final_fingerprint": run["final_fingerprint"],
    }


def _close(got: float | None, want: float | None, tolerance: tuple[float, float]) -> bool:
    if got is None or want is None:
        return got is want
    absolute, relative = tolerance
    return math.isclose(got, want, abs_tol=absolute, rel_tol=relative)


@pytest.fixture(scope="module")
def portable() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PORTABLE.read_text())
    return data


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    recordings: list[dict[str, Any]] = json.loads(PINNED.read_text())["recordings"]
    here = _environment()
    for data in recordings:
        if data["environment"] == here:
            return data
    pinned_on = [data["environment"] for data in recordings]
    pytest.skip(f"exact recordings on {pinned_on}, this machine is {here} (portable pin ran)")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_trajectory_matches_portable_pin(name: str, portable: dict[str, Any]) -> None:
    """Runs everywhere: exact counts and plans, float results within tolerance."""
    got = _portable(run_scenario(name))
    want = portable["scenarios"][name]
    assert got["final_version"] == want["final_version"]
    assert len(got["rounds"]) == len(want["rounds"])
    for i, (g, w) in enumerate(zip(got["rounds"], want["rounds"], strict=True), start=1):
        differ = {key: (g[key], w[key]) for key in EXACT if g[key] != w[key]}
        assert not differ, f"{name}: round {i} differs (got, pinned): {differ}"
        for key, tolerance in TOLERANCE.items():
            assert _close(g[key], w[key], tolerance), (
                f"{name}: round {i} {key} {g[key]} vs pinned {w[key]} (tolerance {tolerance})"
            )


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_trajectory_matches_exact_recording(name: str, pinned: dict[str, Any]) -> None:
    """Where this environment was recorded: every round bit for bit."""
    if name not in pinned["scenarios"]:
        pytest.skip(f"{name}: no exact recording in this environment (portable pin ran)")
    got = _strict(run_scenario(name))
    want = pinned["scenarios"][name]
    assert got["final_version"] == want["final_version"]
    for i, (g, w) in enumerate(zip(got["rounds"], want["rounds"], strict=True), start=1):
        assert g == w, f"{name}: round {i} differs"
    assert got["final_fingerprint"] == want["final_fingerprint"]


def test_exact_recordings_agree_with_portable_pin(portable: dict[str, Any]) -> None:
    """Every environment's exact recording has the portable reference's bytes and plans."""
    recordings: list[dict[str, Any]] = json.loads(PINNED.read_text())["recordings"]
    assert recordings
    assert any(set(data["scenarios"]) == set(SCENARIOS) for data in recordings)
    for data in recordings:
        assert set(data["scenarios"]) <= set(SCENARIOS), data["environment"]
        for name in data["scenarios"]:
            want = portable["scenarios"][name]
            rec = data["scenarios"][name]
            assert rec["final_version"] == want["final_version"]
            for key in ("bytes_up", "bytes_down", "catch_up", "replicas_equal"):
                assert [r[key] for r in rec["rounds"]] == [r[key] for r in want["rounds"]], (
                    f"{data['environment']} {name} {key}"
                )
            assert [len(r["fingerprints"]) for r in rec["rounds"]] == [
                r["reporters"] for r in want["rounds"]
            ]


def test_pinned_scenarios_exercise_catch_up(portable: dict[str, Any]) -> None:
    """The partial scenarios sample subsets and catch up both by log replay and by snapshot."""
    for name in ("partial-reternarize", "partial-shared-scale-sum"):
        rounds = portable["scenarios"][name]["rounds"]
        assert max(r["reporters"] for r in rounds) < NODES
        kinds = {k.split(":")[0] for r in rounds[1:] for k in r["catch_up"]}
        assert {"log", "snapshot"} <= kinds, kinds


def _record() -> None:
    runs = {name: run_scenario(name) for name in sorted(SCENARIOS)}
    portable = {"scenarios": {name: _portable(run) for name, run in runs.items()}}
    PORTABLE.write_text(json.dumps(portable, indent=1, sort_keys=True) + "\n")
    data = {
        "environment": _environment(),
        "scenarios": {name: _strict(run) for name, run in runs.items()},
    }
    recordings = json.loads(PINNED.read_text())["recordings"] if PINNED.exists() else []
    others = [r for r in recordings if r["environment"] != data["environment"]]
    PINNED.write_text(json.dumps({"recordings": [*others, data]}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PORTABLE} and {PINNED}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_pinned_trajectory --record")
    _record()
