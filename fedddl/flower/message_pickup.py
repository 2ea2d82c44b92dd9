"""Quicker message pickup in Flower's simulation engine: woken by the ServerApp's pushes.

Within :func:`quick_message_pickup` the engine's pickup loop (Flower's loop body,
unchanged) runs as soon as the ServerApp pushes messages
(:meth:`PickupSession.messages_pushed`, called by
:class:`fedddl.flower.grid.FastPollGrid`), and otherwise every
:func:`pickup_interval_s`; each stored reply ends the grid's wait
(:meth:`PickupSession.wait_for_replies`); when the simulation returns its session is
closed, so a ServerApp thread that outlived it stops waiting. Outside it, or when
Flower's module lacks the expected functions (logged), nothing changes and
:func:`current_session` is None. Why and how long the ticks were: docs/round-time.md.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from logging import WARNING
from queue import Empty, Queue
from typing import Any

__all__ = ["PickupSession", "current_session", "pickup_interval_s", "quick_message_pickup"]

#: Flower 1.42's interval between two looks for new messages.
FLOWER_INTERVAL_S = 0.1
_MIN_INTERVAL_S = 0.01
_PER_NODE_S = 0.001
_PICKUP_PARAMETERS = ("state", "queue", "nodes_mapping", "f_stop")
_STORE_PARAMETERS = ("state", "queue", "f_stop")
_lock = threading.Lock()


class PickupSession:
    """The signals of one simulation run inside :func:`quick_message_pickup`.

    ``pushed`` wakes the engine's pickup loop, ``stored`` the grid's wait for replies, and
    ``closed`` is set when the simulation has returned (normally or not): a ServerApp thread
    that outlived it (Flower leaves it running when the engine fails to start) must stop
    waiting for replies that can no longer come.
    """

    def __init__(self) -> None:
        self.pushed = threading.Event()
        self.stored = threading.Event()
        self.closed = threading.Event()

    def messages_pushed(self) -> None:
        """Wake the pickup loop now."""
        self.pushed.set()

    def wait_for_replies(self, timeout: float) -> None:
        """Wait ``timeout`` seconds, or until a reply is stored or the simulation ended."""
        self.stored.wait(timeout)
        if not self.closed.is_set():
            self.stored.clear()  # a reply stored after the caller's pull and before this
            # line is pulled by the caller's next pull anyway: no reply lost, only a wake-up

    def is_closed(self) -> bool:
        """Whether the simulation has returned."""
        return self.closed.is_set()

    def close(self) -> None:
        """Mark the simulation ended and wake every waiter."""
        self.closed.set()
        self.stored.set()
        self.pushed.set()


class _Current:
    session: PickupSession | None = None


def current_session() -> PickupSession | None:
    """The session of the simulation running in this process (None outside one)."""
    return _Current.session


def pickup_interval_s(num_nodes: int) -> float:
    """Seconds between two looks for new messages (when no push wakes the loop sooner)."""
    return max(_MIN_INTERVAL_S, min(FLOWER_INTERVAL_S, _PER_NODE_S * num_nodes))


@contextmanager
def quick_message_pickup(num_nodes: int) -> Iterator[float]:
    """Within the ``with`` block, simulations pick up messages when pushed (see the module
    docstring).

    Yields the idle interval in use (Flower's 0.1 s when the engine could not be changed).
    Not reentrant across threads: one simulation at a time per process, as Flower runs them.
    """
    from flwr.common.logger import log

    try:
        from flwr.server.superlink.fleet.vce import vce_api
    except ImportError as error:
        log(WARNING, "fedddl: message pickup left at Flower's default (%s)", error)
        yield FLOWER_INTERVAL_S
        return
    pickup = getattr(vce_api, "add_messages_to_queue", None)
    store = getattr(vce_api, "put_message_into_state", None)
    if (
        pickup is None
        or store is None
        or tuple(inspect.signature(pickup).parameters) != _PICKUP_PARAMETERS
        or tuple(inspect.signature(store).parameters) != _STORE_PARAMETERS
    ):
        log(WARNING, "fedddl: message pickup left at Flower's default (unexpected engine)")
        yield FLOWER_INTERVAL_S
        return
    interval = pickup_interval_s(num_nodes)
    session = PickupSession()
    pushed, stored = session.pushed, session.stored

    def add_messages_to_queue(
        state: Any, queue: Queue[Any], nodes_mapping: Any, f_stop: threading.Event
    ) -> None:
        # Flower 1.42's loop; it waits for a push (or ``interval``) instead of 0.1 s.
        while not f_stop.is_set():
            pushed.clear()  # a push during the scan below sets it again: scanned next
            for node_id in nodes_mapping:
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            pushed.wait(interval)

    def put_message_into_state(state: Any, queue: Queue[Any], f_stop: threading.Event) -> None:
        # Flower 1.42's loop, signalling each stored reply.
        while not f_stop.is_set():
            try:
                message_reply = queue.get(timeout=1.0)
                state.store_message_res(message_reply)
                stored.set()
            except Empty:
                pass

    with _lock:
        vce_api.add_messages_to_queue = add_messages_to_queue
        vce_api.put_message_into_state = put_message_into_state
        _Current.session = session
        try:
            yield interval
        finally:
            vce_api.add_messages_to_queue = pickup
            vce_api.put_message_into_state = store
            _Current.session = None
            session.close()
