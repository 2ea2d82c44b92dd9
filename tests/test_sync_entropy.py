"""``ternary-entropy`` through the Flower-free server and workers: the same trajectory as
``ternary-base3`` (the codes are identical), with smaller uplink and downlink messages."""

from __future__ import annotations

import pytest

from fedddl.compression.codecs import entropy as entropy_format
from fedddl.sync import ReplicaServer
from tests.test_sync_server import NODES, Cluster


def _run(compressor: str, downlink: str, rounds: int = 3) -> tuple[str, list[int], list[bytes]]:
    # one scale per tensor on both sides: ternary-entropy carries no buckets, and the
    # comparison is of the same codes
    cluster = Cluster(compressor=compressor, downlink=downlink, scale_bucket=0)
    sizes: list[int] = []
    for _ in range(rounds):
        replies = cluster.replies()
        sizes += [len(r.payload) for r in replies if r.payload is not None]
        cluster.server.aggregate(cluster.round + 1, replies)
    server: ReplicaServer = cluster.server
    for report in server.reports:
        assert report.replicas_equal is not False and len(report.accepted) == len(NODES)
    payloads = [message for _, message in server.log.since(0)]
    return server.shadow.fingerprint(), sizes, payloads


@pytest.mark.parametrize("downlink", ["reternarize", "shared-scale-sum"])
def test_same_trajectory_as_base3_with_smaller_messages(downlink: str) -> None:
    base3, base3_sizes, _ = _run("ternary-base3", downlink)
    coded, coded_sizes, downlinks = _run("ternary-entropy", downlink)
    assert coded == base3  # bit-identical replicas after the same rounds
    # the logits layer travels in fp32 (an exemption): only the ternary part shrinks
    assert sum(coded_sizes) < 0.9 * sum(base3_sizes)
    assert all(c <= b for c, b in zip(coded_sizes, base3_sizes, strict=True))
    if downlink == "reternarize":  # the re-encoded broadcast is entropy-coded too
        assert any(entropy_format.MAGIC in message[:5] for message in downlinks)
