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

from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import log

__all__ = ["Notices", "Traffic", "array_bytes", "with_traffic"]

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


def _nodes(nodes: list[int], shown: int) -> str:
    names = ", ".join(str(n) for n in nodes[:shown])
    more = f" and {len(nodes) - shown} more" if len(nodes) > shown else ""
    return f"node{'s' if len(nodes) > 1 else ''} {names}{more}:"
