"""The SuperNode's Fleet API timeout patch (fedddl.flower.fleet_timeout)."""

from __future__ import annotations

import sys

import httpx
import pytest
from flwr.supernode.fleet_http_client import FleetHttpClient

from fedddl.flower.fleet_timeout import FLEET_TIMEOUT_S, patch_fleet_timeout


def _build() -> FleetHttpClient:
    return FleetHttpClient.from_server_address(
        "127.0.0.1:1", insecure=True, root_certificates=None, interceptors=())


@pytest.fixture
def restore(monkeypatch: pytest.MonkeyPatch) -> None:
    # Recorded here, so the class attribute the patch sets is removed after the test.
    monkeypatch.setattr(FleetHttpClient, "from_server_address",
                        FleetHttpClient.from_server_address)


def test_flower_s_own_timeout_is_the_30_s_the_patch_replaces(restore: None) -> None:
    client = _build()
    assert client._client.timeout == httpx.Timeout(30.0)
    client._client.close()


def test_patched_clients_get_the_longer_timeout_and_patching_again_replaces_it(
        restore: None) -> None:
    original = FleetHttpClient.from_server_address.__func__  # type: ignore[attr-defined]
    patch_fleet_timeout(120.0)
    client = _build()
    assert client._client.timeout == httpx.Timeout(120.0)
    client._client.close()
    patch_fleet_timeout(FLEET_TIMEOUT_S)
    wrapper = FleetHttpClient.from_server_address.__func__  # type: ignore[attr-defined]
    assert wrapper.__wrapped__ is original  # wraps Flower's own, not the first wrapper
    client = _build()
    assert client._client.timeout == httpx.Timeout(FLEET_TIMEOUT_S)
    client._client.close()


def test_patch_refuses_a_nonsense_timeout(restore: None) -> None:
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="fleet timeout"):
            patch_fleet_timeout(bad)


def test_fast_supernode_applies_its_fleet_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import flwr.supernode.cli

    from fedddl.flower import fast_supernode

    seen: list[float] = []
    monkeypatch.setattr(fast_supernode, "patch_supernode_polling", lambda *a: None)
    monkeypatch.setattr(fast_supernode, "patch_object_pulls", lambda *a: None)
    monkeypatch.setattr(fast_supernode, "patch_fleet_timeout", seen.append)
    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", lambda: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert fast_supernode.main(["--", "--insecure"]) == 0
    assert fast_supernode.main(["--fleet-timeout", "45", "--", "--insecure"]) == 0
    assert seen == [FLEET_TIMEOUT_S, 45.0]
