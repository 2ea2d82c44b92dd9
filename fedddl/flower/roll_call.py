"""The roll call of an attack evaluation: which node holds which partition.

In Flower's simulation (and in a deployment) the ServerApp sees node ids only, while the
attackers are chosen by partition id (:func:`fedddl.attacks.attacker_partitions`). When a
run injects an attack, the ServerApp first sends every node one ``query.roll_call``
message; each ClientApp answers with its ``partition-id``. This is evaluation bookkeeping
(the results name the attacking nodes), never used to accept or refuse a reply; its bytes
are not counted in the rounds' figures.

Request: an empty :class:`~flwr.app.RecordDict`. Reply: ``"roll-call"``
:class:`~flwr.app.MetricRecord` with ``partition-id``.
"""

from __future__ import annotations

from flwr.app import Message, MetricRecord, RecordDict

from fedddl.flower.records import record_of

__all__ = ["ACTION", "MESSAGE_TYPE", "build_roll_call_reply", "parse_roll_call_reply"]

ACTION = "roll_call"
MESSAGE_TYPE = f"query.{ACTION}"
RECORD = "roll-call"
PARTITION_ID = "partition-id"


def build_roll_call_reply(partition_id: int) -> RecordDict:
    """The content of a node's answer."""
    return RecordDict({RECORD: MetricRecord({PARTITION_ID: partition_id})})


def parse_roll_call_reply(message: Message) -> int:
    """The partition id a node answered.

    Raises
    ------
    ValueError
        If the reply is an error or lacks the record.
    """
    if message.has_error():
        raise ValueError(f"roll call: node replied with error: {message.error.reason}")
    record = record_of(message.content, RECORD, MetricRecord)
    value = None if record is None else record.get(PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"roll call: reply lacks an int {PARTITION_ID!r}")
    return value
