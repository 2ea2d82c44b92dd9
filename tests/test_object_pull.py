"""Short retry waits for Flower's object pulls (fedddl.flower.object_pull)."""

from __future__ import annotations

import importlib
import itertools
import sys
import time
import types
from typing import Any

import pytest
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

from fedddl.deploy.processes import WARM_CLIENTAPP_PRELOAD
from fedddl.flower import object_pull
from fedddl.flower.object_pull import (
    CLIENTAPP,
    PATCH_SITES,
    SERVERAPP,
    SUPERNODE,
    patch_object_pulls,
)


@pytest.fixture
def restore_sites(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put every site's function back after the test."""
    for module_name, name in PATCH_SITES.items():
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, name, getattr(module, name))


def _flaky(unavailable: int) -> tuple[Any, list[float]]:
    """A pull function whose object is unavailable ``unavailable`` times, then arrives."""
    calls: list[float] = []

    def pull(object_id: str) -> bytes:
        calls.append(time.monotonic())
        if len(calls) <= unavailable:
            raise ObjectUnavailableError(object_id)
        return b"content"

    return pull, calls


@pytest.mark.usefixtures("restore_sites")
def test_patched_serverapp_pull_retries_within_the_cap() -> None:
    """Three 'not yet available' answers cost at most 3 x 0.2 s x 1.2 (Flower's own
    backoff: 1 + 2 + 4 s, each -20 %, i.e. at least 5.6 s)."""
    assert patch_object_pulls(SERVERAPP) == [f"{SERVERAPP}.pull_objects"]
    module = importlib.import_module(SERVERAPP)
    pull, calls = _flaky(3)
    start = time.monotonic()
    assert module.pull_objects(["a"], pull) == {"a": b"content"}
    assert len(calls) == 4
    assert time.monotonic() - start < 3.0
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert max(gaps) < 1.0 and min(gaps) >= 0.04 * 0.8 - 0.005


@pytest.mark.usefixtures("restore_sites")
def test_patch_has_no_retry_count_limit_and_keeps_explicit_arguments() -> None:
    """Flower stops after 500 tries (about 100 s at a 0.2 s cap: too soon for a big message
    on a slow link); the patched pull has no count limit, and a caller's explicit
    arguments still win."""
    patch_object_pulls(SERVERAPP, initial_backoff_s=0.001, backoff_cap_s=0.001)
    module = importlib.import_module(SERVERAPP)
    pull, calls = _flaky(600)
    assert module.pull_objects(["a"], pull) == {"a": b"content"}
    assert len(calls) == 601
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError

    pull, calls = _flaky(10)
    with pytest.raises(ObjectPullError):
        module.pull_objects(["a"], pull, max_tries_per_object=3)
    assert len(calls) == 3


@pytest.mark.usefixtures("restore_sites")
def test_every_site_is_patched_and_repatching_replaces_the_waits() -> None:
    patched = patch_object_pulls()
    assert patched == [f"{m}.{n}" for m, n in PATCH_SITES.items()]
    clientapp = importlib.import_module(CLIENTAPP)
    first = clientapp.pull_and_inflate_object_from_tree
    patch_object_pulls(CLIENTAPP, initial_backoff_s=0.5, backoff_cap_s=1.0)
    second = clientapp.pull_and_inflate_object_from_tree
    assert second is not first
    assert second.__wrapped__ is first.__wrapped__  # wraps Flower's function, not our wrapper
    supernode = importlib.import_module(SUPERNODE)
    assert getattr(supernode.pull_objects, "__wrapped__", None) is not None


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="initial_backoff_s"):
        patch_object_pulls(initial_backoff_s=0.0)
    with pytest.raises(ValueError, match="initial_backoff_s"):
        patch_object_pulls(initial_backoff_s=0.5, backoff_cap_s=0.1)
    with pytest.raises(ValueError, match="not an object-pull site"):
        patch_object_pulls("flwr.somewhere.else")


def test_a_site_that_no_longer_takes_backoff_arguments_is_not_patched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = types.ModuleType("fake_flwr_site")

    def pull_objects(object_ids: list[str], pull_object_fn: Any) -> dict[str, bytes]:
        return {}

    fake.pull_objects = pull_objects  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_flwr_site", fake)
    monkeypatch.setitem(object_pull.PATCH_SITES, "fake_flwr_site", "pull_objects")
    with pytest.raises(RuntimeError, match=r"does not look like Flower 1\.42"):
        patch_object_pulls("fake_flwr_site")
    assert fake.pull_objects is pull_objects  # type: ignore[attr-defined]


@pytest.mark.usefixtures("restore_sites")
def test_deployment_processes_apply_the_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ServerApp's fast_poll, the warm ClientApp preload and the fast SuperNode
    launcher each patch their own site."""
    import flwr.supernode.cli
    from flwr.superlink.grid.http_grid import HttpGrid

    from fedddl.deploy.warm_clientapp import preload_modules
    from fedddl.flower import fast_supernode
    from fedddl.flower.grid import fast_poll

    monkeypatch.setattr(fast_supernode, "patch_supernode_polling", lambda *a: None)
    monkeypatch.setattr(fast_supernode, "patch_fleet_timeout", lambda *a: None)
    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", lambda: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert fast_supernode.main(["--", "--insecure"]) == 0
    assert getattr(importlib.import_module(SUPERNODE).pull_objects, "__wrapped__", None)

    fast_poll(HttpGrid(token="not-connected"))  # connects lazily: nothing is contacted
    assert getattr(importlib.import_module(SERVERAPP).pull_objects, "__wrapped__", None)
    entry = "fedddl.flower.object_pull:patch_clientapp_pulls"
    assert entry in WARM_CLIENTAPP_PRELOAD
    preload_modules([entry])
    clientapp = importlib.import_module(CLIENTAPP)
    assert getattr(clientapp.pull_and_inflate_object_from_tree, "__wrapped__", None)
