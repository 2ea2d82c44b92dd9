"""The checks of an incoming gossip frame that need no peer list: identity, mode, model layout.

Pure functions over the decoded :class:`~fedddl.gossip.wire.Frame`; each refusal is a
:class:`~fedddl.gossip.admission.RejectedFrame` with a gRPC status and a counting key.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
import torch

from fedddl.gossip.admission import RejectedFrame
from fedddl.gossip.wire import Frame, FrameKind

__all__ = ["ModelSpec", "check_frame", "check_spec"]

#: Name -> (shape, dtype) of every tensor of a node's model.
ModelSpec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def check_frame(
    frame: Frame,
    node_id: int,
    caller: int | None,
    secure: bool,
    compressed: bool,
    spec: ModelSpec,
) -> None:
    """Refuse ``frame`` unless its sender, kind and tensors fit the receiving node.

    Parameters
    ----------
    frame : Frame
        The decoded frame.
    node_id : int
        The receiving node's id.
    caller : int, optional
        Node id of the caller's verified certificate (``None`` without TLS).
    secure : bool
        Whether the receiver talks mutual TLS (then ``caller`` must name the sender).
    compressed : bool
        Whether the receiver runs compressed gossip (DELTA frames) or not (MODEL frames).
    spec : ModelSpec
        The receiver's model layout, which a MODEL frame must match exactly.

    Raises
    ------
    RejectedFrame
        On the first check that fails.
    """
    sender = frame.sender
    if secure:
        if caller is None:
            raise RejectedFrame(
                grpc.StatusCode.PERMISSION_DENIED,
                "the caller's certificate names no gossip node",
                "no-identity",
            )
        if caller != sender:
            raise RejectedFrame(
                grpc.StatusCode.PERMISSION_DENIED,
                f"frame claims to be from node {sender}, but the caller's certificate "
                f"is node {caller}'s",
                "identity-mismatch",
                caller,
            )
    if sender == node_id:
        raise RejectedFrame(
            grpc.StatusCode.PERMISSION_DENIED, "frame claims to be from me", "claims-me"
        )
    if frame.kind is FrameKind.MODEL:
        if compressed:
            raise RejectedFrame(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this node runs compressed gossip: send DELTA frames",
                "wrong-mode",
                sender,
            )
        check_spec(sender, frame.tensors, spec)
    if frame.kind is FrameKind.DELTA and not compressed:
        raise RejectedFrame(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this node runs uncompressed gossip: send MODEL frames",
            "wrong-mode",
            sender,
        )


def check_spec(sender: int, tensors: Mapping[str, torch.Tensor], spec: ModelSpec) -> None:
    """Refuse ``tensors`` unless names, shapes and dtypes equal ``spec``'s."""
    if set(tensors) != set(spec):
        diff = sorted(set(tensors) ^ set(spec))
        raise RejectedFrame(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"tensor names differ from my model: {diff}",
            "model-mismatch",
            sender,
        )
    for name, tensor in tensors.items():
        shape, dtype = spec[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RejectedFrame(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, mine is"
                f" {shape} {dtype}",
                "model-mismatch",
                sender,
            )
