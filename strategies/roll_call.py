"""The ServerApp's roll call of an attack evaluation (:mod:`fedddl.flower.roll_call`).

Asks every connected node for its partition id, so the results can name the nodes that
ran the attack. Evaluation bookkeeping only: nothing a node answers here changes how its
replies are judged.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING

from flwr.app import Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedddl.flower.roll_call import MESSAGE_TYPE, parse_roll_call_reply

__all__ = ["roll_call"]


def roll_call(grid: Grid, min_nodes: int, wait_timeout: float = 600.0) -> dict[int, int]:
    """Wait for ``min_nodes`` nodes, then return ``{node id: partition id}`` of those that answer.

    Raises
    ------
    TimeoutError
        If fewer than ``min_nodes`` nodes connect within ``wait_timeout`` seconds.
    """
    deadline = time.monotonic() + wait_timeout
    while len(nodes := sorted(grid.get_node_ids())) < min_nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"roll call: {len(nodes)} nodes connected, need {min_nodes}")
        time.sleep(0.1)
    messages = [
        Message(content=RecordDict(), dst_node_id=node, message_type=MESSAGE_TYPE)
        for node in nodes
    ]
    mapping: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=wait_timeout):
        node = int(reply.metadata.src_node_id)
        try:
            mapping[node] = parse_roll_call_reply(reply)
        except ValueError as err:
            log(WARNING, "roll call: node %d: %s", node, err)
    log(INFO, "roll call: %d of %d nodes answered", len(mapping), len(nodes))
    return mapping
