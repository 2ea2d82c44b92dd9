"""The ClientApp's answer to an attack evaluation's roll call (:mod:`fedddl.flower.roll_call`)."""

from __future__ import annotations

from flwr.app import Context, Message

from clients.shard import partition_of
from fedddl.flower.roll_call import build_roll_call_reply

__all__ = ["handle_roll_call"]


def handle_roll_call(message: Message, context: Context) -> Message:
    """Answer with this node's ``partition-id``."""
    pid, _ = partition_of(context.node_config)
    return Message(content=build_roll_call_reply(pid), reply_to=message)
