"""Catch-up planning: what each sampled node gets to reach the shadow replica's version.

A node gets the logged updates it misses, or a snapshot of the shadow replica when it is
further behind than the log reaches; costly resyncs (a snapshot, or more than one update)
are rate-limited per node (:mod:`fedddl.sync.resync_limit`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fedddl.replica import CatchUp
from fedddl.sync.grid_shadow import GridShadow
from fedddl.sync.messages import TrainInstruction
from fedddl.sync.nodes import NodeBook
from fedddl.sync.resync_limit import ResyncLimiter
from fedddl.sync.shadow import ShadowReplica

__all__ = ["CatchUpPlanner"]


class CatchUpPlanner:
    """Plans each round's instructions from what it knows about each node.

    Attributes
    ----------
    nodes : NodeBook
        What the server knows about each node's replica.
    resyncs : ResyncLimiter
        The resync rate limit.
    """

    def __init__(self, resync_interval: int) -> None:
        self.nodes = NodeBook()
        self.resyncs = ResyncLimiter(resync_interval)
        self._limited: list[int] = []

    def plan(
        self,
        server_round: int,
        nodes: Iterable[int],
        shadow: ShadowReplica | GridShadow,
        compressor: str,
        scales: torch.Tensor | None,
        want_scales: bool,
    ) -> dict[int, TrainInstruction]:
        """The instruction of every node of this (global) round; nodes in the same situation
        share one instruction object (a transport serializes it once).

        ``compressor``: the round's uplink compressor; ``scales``: the shared scales sent
        when ``want_scales`` (clients report local scales for the shared-scale sum).
        """
        current = shadow.replica.version
        snapshot: dict[str, torch.Tensor] | None = None
        shared: dict[tuple[str, int, bool], TrainInstruction] = {}
        plan: dict[int, TrainInstruction] = {}
        limited: list[int] = []
        for node in nodes:
            known = self.nodes.known_version(node)
            catch_up = shadow.catch_up(known)
            if _costly(catch_up, known, current):
                if self.resyncs.holds_back(node, server_round):
                    known, catch_up = _usual_catch_up(current, shadow)
                    limited.append(node)
                else:
                    self.resyncs.served(node, server_round)
            tell = self.nodes.needs_compressor(node, compressor) or catch_up.kind == "snapshot"
            key = (catch_up.kind, known if catch_up.kind == "log" else -2, tell)
            instruction = shared.get(key)
            if instruction is None:
                if catch_up.kind == "snapshot" and snapshot is None:
                    snapshot = shadow.snapshot()
                instruction = TrainInstruction(
                    server_round=server_round,
                    model_version=current,
                    updates=catch_up.updates,
                    snapshot=snapshot if catch_up.kind == "snapshot" else None,
                    snapshot_version=current if catch_up.kind == "snapshot" else -1,
                    compressor=compressor if tell else None,
                    scales=scales if want_scales else None,
                    want_scales=want_scales,
                )
                shared[key] = instruction
            self.nodes.sent(node, current, compressor)
            plan[node] = instruction
        self._limited = limited
        return plan

    def take_limited(self) -> list[int]:
        """The nodes whose resync the last plan held back (cleared by taking them)."""
        limited, self._limited = self._limited, []
        return limited

    def forget(self) -> None:
        """Forget every node (after a restore): each node's first message is a snapshot."""
        self.nodes.forget(unknown_version=-1)
        self.resyncs.forget()


def _costly(catch_up: CatchUp, known: int, current: int) -> bool:
    """A resync: a snapshot, or a catch-up over more than one version."""
    return catch_up.kind == "snapshot" or (catch_up.kind == "log" and current - known > 1)


def _usual_catch_up(current: int, shadow: ShadowReplica | GridShadow) -> tuple[int, CatchUp]:
    """What a node one version behind gets: the latest logged update (or nothing)."""
    if current >= 1:
        usual = shadow.catch_up(current - 1)
        if usual.kind == "log":
            return current - 1, usual
    return current, CatchUp("none", [])
