"""Quicker message pickup in Flower's simulation engine.

Flower 1.42's simulation engine moves the ServerApp's messages to the client workers in a
thread (``vce_api.add_messages_to_queue``) that looks for new messages every 0.1 s. A round
therefore lasts a whole number of those ticks: a round whose work takes 0.11 s takes 0.2 s,
and two strategies whose rounds differ by a few milliseconds can differ by 0.1 s, depending
on where the round falls against the tick. :class:`fedddl.flower.grid.FastPollGrid` already
shortens the other direction (the ServerApp's reply poll).

:func:`quick_message_pickup` runs a simulation with the same loop at a shorter interval.
Each tick scans Flower's in-memory message store once per node, so the interval grows with
the federation: ``max(0.01, min(0.1, 0.001 * num_nodes))`` seconds (10 ms up to 10 nodes,
Flower's own 0.1 s from 100 nodes on). Only the wait changes; the loop's body is Flower's.
If Flower's module does not have the expected function, nothing is changed and the reason
is logged.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from logging import WARNING
from queue import Queue
from typing import Any

__all__ = ["pickup_interval_s", "quick_message_pickup"]

#: Flower 1.42's interval between two looks for new messages.
FLOWER_INTERVAL_S = 0.1
_MIN_INTERVAL_S = 0.01
_PER_NODE_S = 0.001
_EXPECTED_PARAMETERS = ("state", "queue", "nodes_mapping", "f_stop")
_lock = threading.Lock()


def pickup_interval_s(num_nodes: int) -> float:
    """Seconds between two looks for new messages in a simulation of ``num_nodes`` nodes."""
    return max(_MIN_INTERVAL_S, min(FLOWER_INTERVAL_S, _PER_NODE_S * num_nodes))


@contextmanager
def quick_message_pickup(num_nodes: int) -> Iterator[float]:
    """Within the ``with`` block, simulations pick up messages every :func:`pickup_interval_s`.

    Yields the interval in use (Flower's 0.1 s when the engine could not be changed).
    Not reentrant across threads: one simulation at a time per process, as Flower runs them.
    """
    from flwr.common.logger import log

    try:
        from flwr.server.superlink.fleet.vce import vce_api
    except ImportError as error:
        log(WARNING, "fedddl: message pickup left at Flower's default (%s)", error)
        yield FLOWER_INTERVAL_S
        return
    original = getattr(vce_api, "add_messages_to_queue", None)
    if original is None or tuple(inspect.signature(original).parameters) != _EXPECTED_PARAMETERS:
        log(WARNING, "fedddl: message pickup left at Flower's default (unexpected engine)")
        yield FLOWER_INTERVAL_S
        return
    interval = pickup_interval_s(num_nodes)

    def add_messages_to_queue(
        state: Any, queue: Queue[Any], nodes_mapping: Any, f_stop: threading.Event
    ) -> None:
        # Flower 1.42's loop, with ``interval`` instead of its fixed 0.1 s wait.
        while not f_stop.is_set():
            for node_id in nodes_mapping:
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(interval)

    with _lock:
        vce_api.add_messages_to_queue = add_messages_to_queue
        try:
            yield interval
        finally:
            vce_api.add_messages_to_queue = original
