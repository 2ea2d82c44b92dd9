"""Replies handed on as they arrive: :class:`ReplyStream`.

Flower's ``Grid.send_and_receive`` returns the replies once every one of them has arrived
(or the timeout passed), so a strategy starts on them only after the slowest client. A
:class:`ReplyStream` holds the same replies in arrival order but receives them while it is
read: a strategy that iterates it (TernGrad's ``aggregate_train`` checks each reply's
payload as it comes) works while the other clients still compute. Asking for its length or
an index first receives every reply, as a list would have them, so a strategy written for a
list works unchanged; it can be iterated any number of times.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

from flwr.app import Message

__all__ = ["ReplyStream"]


class ReplyStream(Sequence[Message]):
    """The replies of one exchange, received as they are read.

    Parameters
    ----------
    arrivals : Iterator[Message]
        Yields each reply when it has arrived and ends when no more will come (all arrived,
        or the timeout passed). An exception it raises (e.g. the simulation ended) reaches
        the reader.
    """

    def __init__(self, arrivals: Iterator[Message]) -> None:
        self._arrivals: Iterator[Message] | None = arrivals
        self._received: list[Message] = []

    def __iter__(self) -> Iterator[Message]:
        index = 0
        while index < len(self._received) or self._receive_one():
            yield self._received[index]
            index += 1

    def _receive_one(self) -> bool:
        """Wait for the next reply; False once none will come."""
        if self._arrivals is None:
            return False
        try:
            self._received.append(next(self._arrivals))
        except StopIteration:
            self._arrivals = None
            return False
        return True

    def receive_all(self) -> list[Message]:
        """Wait for every reply still to come; return all of them in arrival order."""
        while self._receive_one():
            pass
        return list(self._received)

    def __len__(self) -> int:
        return len(self.receive_all())

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...

    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        return self.receive_all()[index]
