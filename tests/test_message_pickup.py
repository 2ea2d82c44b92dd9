"""The simulation engine's message pickup runs at the shorter interval and is restored."""

from __future__ import annotations

import threading
import time
from queue import Queue
from typing import Any

import pytest
from flwr.server.superlink.fleet.vce import vce_api

from fedddl.flower.message_pickup import (
    FLOWER_INTERVAL_S,
    pickup_interval_s,
    quick_message_pickup,
)


class _State:
    """One message for node 7, delivered once (as Flower's link state marks it delivered)."""

    def __init__(self) -> None:
        self.pending = {7: ["message"]}
        self.looks = 0

    def get_message_ins(self, node_id: int, limit: int | None) -> list[Any]:
        self.looks += 1
        found, self.pending[node_id] = self.pending.get(node_id, [])[:limit], []
        return found


def test_interval_grows_with_the_federation_up_to_flowers() -> None:
    assert pickup_interval_s(2) == 0.01
    assert pickup_interval_s(10) == 0.01
    assert pickup_interval_s(50) == pytest.approx(0.05)
    assert pickup_interval_s(10_000) == FLOWER_INTERVAL_S


def test_replacement_loop_picks_up_sooner_and_is_restored() -> None:
    original = vce_api.add_messages_to_queue
    with quick_message_pickup(10) as interval:
        assert interval == 0.01
        loop = vce_api.add_messages_to_queue
        assert loop is not original
        state, queue, stop = _State(), Queue(), threading.Event()  # type: ignore[var-annotated]
        thread = threading.Thread(target=loop, args=(state, queue, {7: 0, 8: 1}, stop))
        start = time.perf_counter()
        thread.start()
        assert queue.get(timeout=5) == "message"
        time.sleep(0.2)
        stop.set()
        thread.join(timeout=5)
        elapsed = time.perf_counter() - start
    assert vce_api.add_messages_to_queue is original
    assert not thread.is_alive() and queue.empty()
    # two nodes looked at every ~10 ms: far more looks than Flower's 0.1 s would make
    assert state.looks >= 2 * (elapsed / FLOWER_INTERVAL_S + 3)


def test_unexpected_engine_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def other(state: Any, queue: Any) -> None:  # another Flower's signature
        raise AssertionError("not called")

    monkeypatch.setattr(vce_api, "add_messages_to_queue", other)
    with quick_message_pickup(10) as interval:
        assert interval == FLOWER_INTERVAL_S
        assert vce_api.add_messages_to_queue is other
