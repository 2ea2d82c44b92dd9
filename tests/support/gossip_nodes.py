"""Small in-process gossip nodes and a raw frame sender, for the peer tests."""

from __future__ import annotations

from pathlib import Path

import grpc
import torch

from fedddl.deploy.certs import write_tls_material
from fedddl.gossip.local_peers import run_to_completion
from fedddl.gossip.peer_node import NodeConfig, PeerNode, TrainingData
from fedddl.gossip.scheduler import PeerState
from fedddl.gossip.tls import PeerTls, peer_name
from fedddl.gossip.transport import EXCHANGE_METHOD
from fedddl.gossip.wire import FrameKind, decode_frame, encode_frame
from fedddl.models import create_model

__all__ = [
    "issue_certs",
    "make_node",
    "model_frame",
    "raw_send",
    "run_to_completion",
    "tiny_data",
]


def tiny_data(seed: int) -> TrainingData:
    """64 random digits-shaped images: enough to run SGD steps, nothing to learn."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(64, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)
    return TrainingData(x, y, x[:32], y[:32])


def make_node(
    node_id: int,
    *,
    tls: PeerTls | None = None,
    data: TrainingData | None = None,
    **config: object,
) -> PeerNode:
    """A digits-MLP node (seed-0 model) on a free loopback port."""
    cfg = NodeConfig(node_id=node_id, **config)  # type: ignore[arg-type]
    return PeerNode(cfg, create_model("digits", seed=0), data or tiny_data(node_id), tls=tls)


def issue_certs(folder: Path, peers: int) -> Path:
    """``fedddl deploy certs`` material with ``peers`` gossip certificates; the gossip dir."""
    paths = write_tls_material(folder, gossip_peers=peers)
    assert paths.gossip_dir is not None
    return paths.gossip_dir


def model_frame(
    tensors: dict[str, torch.Tensor], sender: int = 1, version: int = 5
) -> bytes:
    """A MODEL frame from ``sender`` at clock ``version``."""
    return encode_frame(FrameKind.MODEL, sender, PeerState(sender, True, version), tensors)


def raw_send(
    address: str,
    data: bytes,
    *,
    tls: PeerTls | None = None,
    server_node: int = 0,
    credentials: grpc.ChannelCredentials | None = None,
) -> tuple[grpc.StatusCode, str]:
    """Send one frame; return the status (OK for an ACK) and the error details."""
    options: list[tuple[str, int | str]] = [("grpc.max_send_message_length", -1)]
    if tls is not None:
        credentials = tls.channel_credentials()
    if credentials is not None:
        options.append(("grpc.ssl_target_name_override", peer_name(server_node)))
        channel = grpc.secure_channel(address, credentials, options)
    else:
        channel = grpc.insecure_channel(address, options)
    with channel:
        call = channel.unary_unary(
            EXCHANGE_METHOD, request_serializer=None, response_deserializer=None
        )
        try:
            reply = call(data, timeout=10)
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            return exc.code(), exc.details() or ""
    assert decode_frame(reply).kind is FrameKind.ACK
    return grpc.StatusCode.OK, ""
