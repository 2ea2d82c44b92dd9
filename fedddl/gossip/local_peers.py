"""Run several real gossip peers of one process to completion (tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence

from fedddl.gossip.peer_node import PeerNode

__all__ = ["run_to_completion"]


def run_to_completion(nodes: Sequence[PeerNode], timeout_s: float) -> bool:
    """Serve ``nodes``, give each the others' addresses, train them all, stop them.

    Returns whether every node finished its steps within ``timeout_s`` (each); the nodes
    are stopped in every case.
    """
    for node in nodes:
        node.serve()
    addresses = {n.node_id: n.server.address for n in nodes}
    try:
        for node in nodes:
            node.set_peers(addresses)
        for node in nodes:
            node.start_training()
        return all(node.wait_done(timeout_s) for node in nodes)
    finally:
        for node in nodes:
            node.stop(grace_s=0)
