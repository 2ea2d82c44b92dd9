"""Quicker message pickup in Flower's simulation engine: woken by the ServerApp's pushes.

Flower 1.42's simulation engine moves the ServerApp's messages to the client workers in a
thread (``vce_api.add_messages_to_queue``) that looks for new messages every 0.1 s, and the
ServerApp's grid looks for replies every 0.1 s too. A round therefore lasted a whole number
of those ticks: a round whose work takes 0.11 s took 0.2 s, and two strategies whose rounds
differ by a few milliseconds could differ by a whole tick, depending on where each round
fell against the tick (the phase locks: rounds of a steady length meet the tick at the same
point every time).

Within :func:`quick_message_pickup`:

* the pickup loop (Flower's loop body, unchanged) runs as soon as the ServerApp pushes
  messages (:func:`messages_pushed`, called by :class:`fedddl.flower.grid.FastPollGrid`),
  and otherwise every :func:`pickup_interval_s` (10 ms up to 10 nodes, growing with the
  federation to Flower's 0.1 s at 100 nodes: each look scans the message store once per
  node, about 40 µs a node here);
* the thread that stores the client workers' replies (``vce_api.put_message_into_state``,
  Flower's body) signals each stored reply, and :func:`wait_for_replies` (the grid's wait
  between two pulls) returns at that signal instead of sleeping its whole interval.

Outside it (or if Flower's module does not have the expected functions, logged) nothing is
changed: the notifications do nothing and the wait is a plain sleep.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from logging import WARNING
from queue import Empty, Queue
from typing import Any

__all__ = ["messages_pushed", "pickup_interval_s", "quick_message_pickup", "wait_for_replies"]

#: Flower 1.42's interval between two looks for new messages.
FLOWER_INTERVAL_S = 0.1
_MIN_INTERVAL_S = 0.01
_PER_NODE_S = 0.001
_PICKUP_PARAMETERS = ("state", "queue", "nodes_mapping", "f_stop")
_STORE_PARAMETERS = ("state", "queue", "f_stop")
_lock = threading.Lock()


class _Signals:
    """The two events of the running simulation (None: no simulation patched)."""

    pushed: threading.Event | None = None
    stored: threading.Event | None = None


def pickup_interval_s(num_nodes: int) -> float:
    """Seconds between two looks for new messages (when no push wakes the loop sooner)."""
    return max(_MIN_INTERVAL_S, min(FLOWER_INTERVAL_S, _PER_NODE_S * num_nodes))


def messages_pushed() -> None:
    """Wake the pickup loop of the running simulation now (no-op outside one)."""
    event = _Signals.pushed
    if event is not None:
        event.set()


def wait_for_replies(timeout: float) -> None:
    """Wait ``timeout`` seconds, or until the running simulation stores a reply.

    Outside a simulation patched by :func:`quick_message_pickup`, a plain sleep.
    """
    event = _Signals.stored
    if event is None:
        time.sleep(timeout)
        return
    event.wait(timeout)
    event.clear()  # a reply stored after the caller's pull and before this line is
    # pulled by the caller's next pull anyway: clearing loses no reply, only a wake-up


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
    pushed, stored = threading.Event(), threading.Event()

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
        _Signals.pushed, _Signals.stored = pushed, stored
        try:
            yield interval
        finally:
            vce_api.add_messages_to_queue = pickup
            vce_api.put_message_into_state = store
            _Signals.pushed = _Signals.stored = None
