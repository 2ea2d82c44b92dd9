"""What :class:`~fedddl.flower.TernaryDelta` sent: per-exchange counts and its plain notices.

:class:`Traffic` counts one exchange (a round's training or its evaluation): the messages
and replies that carried the model compressed or plain, and the array bytes sent and
saved, as the :class:`~flwr.app.MetricRecord` entries the wrapper merges into the wrapped
strategy's aggregated metrics (so they show in Flower's summary and ``Result``).
:class:`Notices` logs why a message or reply travelled plain, once per node and reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.common.logger import log

from fedddl.flower.delta_protocol import DELTA

__all__ = [
    "Notices",
    "Traffic",
    "TrafficLog",
    "array_bytes",
    "whole_model_reason",
    "with_traffic",
]

#: Prefix of every metric :class:`Traffic` reports.
PREFIX = "fedddl."


def array_bytes(*records: object) -> int:
    """The bytes of the Arrays' data in ``records`` (what is not an ArrayRecord counts 0)."""
    return sum(
        len(array.data)
        for record in records
        if isinstance(record, ArrayRecord)
        for array in record.values()
    )


@dataclass
class Traffic:
    """Counts of one exchange; ``*_bytes``: array bytes sent, ``*_saved``: bytes the
    uncompressed model would have taken beyond them."""

    down_compressed: int = 0
    down_plain: int = 0
    down_bytes: int = 0
    down_saved: int = 0
    up_compressed: int = 0
    up_plain: int = 0
    up_bytes: int = 0
    up_saved: int = 0

    def down(self, compressed: bool, whole: int, sent: int) -> None:
        """A message that carried the model: ``whole`` bytes as built, ``sent`` bytes sent."""
        if compressed:
            self.down_compressed += 1
        else:
            self.down_plain += 1
        self.down_bytes += sent
        self.down_saved += whole - sent

    def up(self, compressed: bool, whole: int, sent: int) -> None:
        """A reply that carried the model (see :meth:`down`)."""
        if compressed:
            self.up_compressed += 1
        else:
            self.up_plain += 1
        self.up_bytes += sent
        self.up_saved += whole - sent

    def add(self, other: Traffic) -> None:
        """Add ``other``'s counts to these."""
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def to_metrics(self) -> dict[str, int]:
        """The counts as metrics: ``fedddl.down.compressed``, ``fedddl.up.bytes-saved``, ..."""
        out = {}
        for field in fields(self):
            direction, what = field.name.split("_")
            what = "bytes-saved" if what == "saved" else what
            out[f"{PREFIX}{direction}.{what}"] = int(getattr(self, field.name))
        return out


def with_traffic(metrics: MetricRecord | None, traffic: Traffic) -> MetricRecord:
    """``metrics`` (the wrapped strategy's, or none) with ``traffic``'s counts added."""
    out = MetricRecord(dict(metrics.items()) if metrics is not None else {})
    for key, value in traffic.to_metrics().items():
        out[key] = value
    return out


class Notices:
    """Log why messages travel plain: one line per reason and round, naming the nodes
    not named for that reason before."""

    #: Nodes named in one line at most (the rest are counted).
    SHOWN = 8

    def __init__(self) -> None:
        self._said: set[tuple[int, str]] = set()
        self._pending: dict[str, tuple[int, str, list[int]]] = {}

    def note(self, node: int, reason: str, text: str, level: int = logging.WARNING) -> None:
        """Remember that ``node`` travelled plain for ``reason`` (said by :meth:`flush`)."""
        if (node, reason) in self._said:
            return
        self._said.add((node, reason))
        pending = self._pending.setdefault(reason, (level, text, []))
        pending[2].append(node)

    def flush(self) -> None:
        """Log what :meth:`note` collected since the last flush."""
        for level, text, nodes in self._pending.values():
            log(level, "TernaryDelta: %s %s", _nodes(nodes, self.SHOWN), text)
        self._pending.clear()


class TrafficLog:
    """What a :class:`~fedddl.flower.TernaryDelta` sent: the current exchange's
    :class:`Traffic`, the run's totals, the :class:`Notices`, the nodes messaged so far."""

    def __init__(self) -> None:
        self.total = Traffic()
        self.exchange = Traffic()
        self.notices = Notices()
        self._known: set[int] = set()

    def down(self, node: int, compressed: bool, whole: int, sent: int) -> bool:
        """Count a message to ``node`` (``whole`` bytes as built, ``sent`` as sent); whether
        the node had been messaged before."""
        self.exchange.down(compressed, whole, sent)
        known = node in self._known
        self._known.add(node)
        return known

    def plain_down(self, node: int, size: int, reason: str, text: str) -> None:
        """Count a message sent as the strategy built it, and say why once."""
        self.exchange.down(False, size, size)
        self.notices.note(node, reason, text)

    def plain_up(self, node: int, content: RecordDict, text: str, reason: str) -> None:
        """Count a reply whose arrays travelled plain (one without arrays carries no model),
        and say why once."""
        records = [r for name, r in content.array_records.items() if name != DELTA]
        if not any(len(r) for r in records):
            return
        size = array_bytes(*records)
        self.exchange.up(False, size, size)
        self.notices.note(node, reason, text)

    def close(self, metrics: MetricRecord | None) -> MetricRecord | None:
        """End the exchange: log the notices, add it to the totals and return ``metrics``
        with its counts (None: no metrics and no model sent)."""
        self.notices.flush()
        exchange, self.exchange = self.exchange, Traffic()
        self.total.add(exchange)
        if metrics is None and exchange == Traffic():
            return None
        return with_traffic(metrics, exchange)


def whole_model_reason(
    downlink: str, known: bool, held: int, behind: int, log_size: int, log_versions: int
) -> tuple[str, str]:
    """``(reason, text)`` of why a node with the mod got the whole model: the downlink is
    off, its first message, it holds nothing usable (``held`` < 0), it is ``behind`` more
    than the ``log_versions`` the update log keeps (``update_log_size=log_size``), or the
    broadcast model started anew."""
    if downlink == "none":
        return "downlink-off", "got the whole model: downlink=False"
    if not known:
        return "new", "got the whole model: first message (no broadcast model yet)"
    if held < 0:
        return "lost", (
            "got the whole model: its last reply failed or did not come, or its state "
            "was lost"
        )
    if behind > log_versions:
        return "behind", (
            f"got the whole model: further behind than the update log "
            f"(update_log_size={log_size})"
        )
    return "new-broadcast", (
        "got the whole model: the global model's layout or dtypes changed, or its "
        "delta could not be encoded"
    )


def _nodes(nodes: list[int], shown: int) -> str:
    names = ", ".join(str(n) for n in nodes[:shown])
    more = f" and {len(nodes) - shown} more" if len(nodes) > shown else ""
    return f"node{'s' if len(nodes) > 1 else ''} {names}{more}:"
