"""fedddl.flower.simulation.run starts Ray again, once, when Ray's node fails to start."""

from __future__ import annotations

from typing import Any

import flwr.simulation
import pytest

from fedddl.flower.simulation import ray_failed_to_start, run

_CONFIG = {"num-server-rounds": 1, "strategy": "terngrad"}


def _startup_failure() -> RuntimeError:
    """What run_simulation raises when Ray's raylet does not register in time."""
    try:
        try:
            raise Exception(
                "The current node timed out during startup. This could happen because some "
                "of the raylet failed to startup or the GCS has become overloaded."
            )
        except Exception as cause:
            raise RuntimeError("Simulation Runtime crashed.") from cause
    except RuntimeError as crashed:
        error = RuntimeError("An error was encountered. Ending simulation.")
        error.__cause__ = crashed
        return error


def _fake(monkeypatch: pytest.MonkeyPatch, errors: list[BaseException]) -> list[int]:
    calls: list[int] = []

    def run_simulation(**kwargs: Any) -> None:
        calls.append(len(calls))
        raise errors[len(calls) - 1]

    monkeypatch.setattr(flwr.simulation, "run_simulation", run_simulation)
    return calls


def _gcs_port_timeout() -> RuntimeError:
    """What run_simulation raised once when Ray's GCS server did not write its port in time."""
    try:
        raise RuntimeError(
            "Timed out waiting for file /tmp/ray/session_2026-12-04_19-38-42_036527_22529/"
            "gcs_server_port_ed6d9be04f7c4e60069b3888c579f75db229f416e35125ac1a94fbc2"
        )
    except RuntimeError as cause:
        error = RuntimeError("An error was encountered. Ending simulation.")
        error.__cause__ = cause
        return error


def test_the_failure_is_recognised_through_the_cause_chain() -> None:
    assert ray_failed_to_start(_startup_failure())
    assert ray_failed_to_start(_gcs_port_timeout())
    assert not ray_failed_to_start(RuntimeError("An error was encountered. Ending simulation."))


def test_a_ray_start_failure_is_retried_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _fake(monkeypatch, [_startup_failure(), RuntimeError("second attempt ran")])
    with pytest.raises(RuntimeError, match="second attempt ran"):
        run(_CONFIG, num_clients=2, progress=None)
    assert len(calls) == 2
    warning = "Ray did not start (The current node timed out during startup)"
    assert warning in capsys.readouterr().err


def test_two_start_failures_give_up_and_other_errors_are_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _fake(monkeypatch, [_startup_failure(), _startup_failure(), _startup_failure()])
    with pytest.raises(RuntimeError, match="Ending simulation"):
        run(_CONFIG, num_clients=2, progress=None)
    assert len(calls) == 2
    calls = _fake(monkeypatch, [RuntimeError("the ServerApp failed"), _startup_failure()])
    with pytest.raises(RuntimeError, match="the ServerApp failed"):
        run(_CONFIG, num_clients=2, progress=None)
    assert len(calls) == 1
