"""The simulation engine's message pickup runs at the shorter interval, wakes on a push,
signals stored replies, and is restored."""

from __future__ import annotations

import threading
import time
from queue import Queue
from typing import Any

import pytest
from flwr.server.superlink.fleet.vce import vce_api

import fedddl.flower.message_pickup as message_pickup
from fedddl.flower.message_pickup import (
    FLOWER_INTERVAL_S,
    PickupSession,
    current_session,
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
        assert vce_api.add_messages_to_queue is other  # type: ignore[comparison-overlap]


def test_a_push_wakes_the_pickup_loop_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(message_pickup, "FLOWER_INTERVAL_S", 30.0)
    monkeypatch.setattr(message_pickup, "_MIN_INTERVAL_S", 30.0)  # idle looks 30 s apart
    with quick_message_pickup(10) as interval:
        assert interval == 30.0
        session = current_session()
        assert session is not None
        state, queue, stop = _State(), Queue(), threading.Event()  # type: ignore[var-annotated]
        state.pending[7] = []
        thread = threading.Thread(
            target=vce_api.add_messages_to_queue, args=(state, queue, {7: 0}, stop)
        )
        thread.start()
        while state.looks < 1:  # the first look found nothing; the loop now waits 30 s
            time.sleep(0.01)
        state.pending[7] = ["pushed"]
        start = time.perf_counter()
        session.messages_pushed()
        assert queue.get(timeout=10) == "pushed"
        waited = time.perf_counter() - start
        stop.set()
        session.messages_pushed()  # end the wait so the thread sees the stop
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert waited < 10  # woken by the push, not by the 30 s interval


def test_a_stored_reply_ends_the_reply_wait() -> None:
    class _Store:
        def __init__(self) -> None:
            self.stored: list[Any] = []

        def store_message_res(self, message: Any) -> None:
            self.stored.append(message)

    original = vce_api.put_message_into_state
    with quick_message_pickup(10):
        session = current_session()
        assert isinstance(session, PickupSession)
        store, queue, stop = _Store(), Queue(), threading.Event()  # type: ignore[var-annotated]
        thread = threading.Thread(
            target=vce_api.put_message_into_state, args=(store, queue, stop)
        )
        thread.start()
        start = time.perf_counter()
        queue.put("reply")
        session.wait_for_replies(30.0)
        waited = time.perf_counter() - start
        stop.set()
        thread.join(timeout=10)
    assert store.stored == ["reply"] and waited < 10
    assert vce_api.put_message_into_state is original
    # The simulation returned: no session any more, and its waits end at once.
    assert current_session() is None and session.is_closed()
    start = time.perf_counter()
    session.wait_for_replies(30.0)
    assert time.perf_counter() - start < 10


def test_a_serverapp_thread_outliving_the_simulation_stops_waiting() -> None:
    """Flower leaves the ServerApp thread running when the engine fails to start; its wait
    for replies must end with the simulation instead of polling forever."""
    from fedddl.flower.grid import FastPollGrid

    class _Silent:  # replies never come
        def push_messages(self, messages: Any) -> list[str]:
            return ["m0"]

        def pull_messages(self, message_ids: Any) -> list[Any]:
            return []

    outcome: list[BaseException | None] = []

    def serverapp(grid: FastPollGrid) -> None:
        try:
            grid.send_and_receive(["message"])  # type: ignore[list-item]
            outcome.append(None)
        except RuntimeError as error:
            outcome.append(error)

    with quick_message_pickup(10):
        session = current_session()
        assert session is not None
        grid = FastPollGrid(
            _Silent(),  # type: ignore[arg-type]
            poll_interval_s=30.0,
            wait=session.wait_for_replies,
            on_push=session.messages_pushed,
            stopped=session.is_closed,
        )
        thread = threading.Thread(target=serverapp, args=(grid,))
        thread.start()
        time.sleep(0.2)
        assert thread.is_alive()  # waiting for its reply
    thread.join(timeout=10)  # the simulation returned: the wait ends at once
    assert not thread.is_alive() and current_session() is None
    assert isinstance(outcome[0], RuntimeError) and "1 replies were awaited" in str(outcome[0])
