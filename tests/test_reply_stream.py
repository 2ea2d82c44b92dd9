"""Replies handed on as they arrive: ReplyStream, the grids that stream, TernGrad reading one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from flwr.app import ArrayRecord, Message

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.flower.grid import CountingGrid, FastPollGrid
from fedddl.flower.reply_stream import ReplyStream
from strategies.registry import build_strategy
from strategies.terngrad import TernGrad
from tests.support.inline_grid import InlineGrid


def _logged(items: list[Any], log: list[str]) -> Iterator[Any]:
    for index, item in enumerate(items):
        log.append(f"arrive {index}")
        yield item


def test_a_stream_receives_while_it_is_read_and_reads_like_a_list() -> None:
    log: list[str] = []
    stream = ReplyStream(_logged(["a", "b", "c"], log))  # type: ignore[arg-type]
    for item in stream:
        log.append(f"read {item}")
    assert log == ["arrive 0", "read a", "arrive 1", "read b", "arrive 2", "read c"]
    assert list(stream) == ["a", "b", "c"] and len(stream) == 3 and stream[1] == "b"
    log.clear()
    lazy = ReplyStream(_logged(["a", "b"], log))  # type: ignore[arg-type]
    assert len(lazy) == 2 and log == ["arrive 0", "arrive 1"]  # a length waits for all
    assert lazy[-1] == "b" and lazy[:1] == ["a"]


def test_an_error_of_the_arrivals_reaches_the_reader_after_the_replies_before_it() -> None:
    def failing() -> Iterator[str]:
        yield "a"
        raise RuntimeError("the simulation ended while 2 replies were awaited")

    stream = ReplyStream(failing())  # type: ignore[arg-type]
    read = []
    with pytest.raises(RuntimeError, match="awaited"):
        for item in stream:
            read.append(item)
    assert read == ["a"]
    assert list(stream) == ["a"]  # nothing more will come


class _ScriptedGrid:
    """Grid double: the reply to message i can be pulled from the (i+1)-th pull on."""

    def __init__(self) -> None:
        self.pulls = 0
        self.pushed: list[str] = []

    def push_messages(self, messages: Iterable[Any]) -> list[str]:
        self.pushed = [f"m{i}" for i, _ in enumerate(messages)]
        return list(self.pushed)

    def pull_messages(self, message_ids: Iterable[str]) -> list[Any]:
        self.pulls += 1
        wanted = set(message_ids)
        ready = [m for i, m in enumerate(self.pushed) if i < self.pulls and m in wanted]
        return [
            SimpleNamespace(
                metadata=SimpleNamespace(reply_to_message_id=m, src_node_id=i),
                has_error=lambda: True,  # error replies: nothing to serialize for counting
            )
            for i, m in enumerate(ready)
        ]


def test_the_fast_poll_grid_hands_each_reply_on_before_pulling_again() -> None:
    inner = _ScriptedGrid()
    grid = FastPollGrid(inner, poll_interval_s=0.001)  # type: ignore[arg-type]
    replies = grid.send_and_receive(["a", "b", "c"])  # type: ignore[list-item]
    assert inner.pushed == ["m0", "m1", "m2"] and inner.pulls == 0  # pushed at once
    seen = []
    for reply in replies:
        seen.append((reply.metadata.reply_to_message_id, inner.pulls))
    assert seen == [("m0", 1), ("m1", 2), ("m2", 3)]


def test_the_counting_grid_counts_streamed_replies_and_settles_unread_ones() -> None:
    inner = _ScriptedGrid()
    counting = CountingGrid(FastPollGrid(inner, poll_interval_s=0.001))  # type: ignore[arg-type]
    messages = [
        SimpleNamespace(metadata=SimpleNamespace(dst_node_id=i), content=None) for i in range(3)
    ]
    counting._count = lambda contents, by_node: sum(1 for _ in contents)  # type: ignore[method-assign]
    replies = iter(counting.send_and_receive(messages))  # type: ignore[arg-type]
    next(replies)
    assert counting.messages_up == 1 and inner.pulls == 1  # counted as it was read
    counting.settle()  # the strategy read no further: the others are received and counted
    assert counting.messages_up == 3 and inner.pulls == 3
    assert counting.exchange_s > 0


def test_terngrad_checks_each_reply_while_the_next_ones_are_still_coming() -> None:
    cfg = AppConfig(num_server_rounds=3)

    class _OneByOne(InlineGrid):
        """Each client computes only when the strategy asks for its reply."""

        def send_and_receive(  # type: ignore[override]
            self, messages: Iterable[Message], *, timeout: float | None = None
        ) -> Iterable[Message]:
            def arrivals() -> Iterator[Message]:
                for index, message in enumerate(list(messages)):
                    log.append(f"arrive {index}")
                    yield from InlineGrid.send_and_receive(self, [message], timeout=timeout)

            return ReplyStream(arrivals())

    def run(grid: InlineGrid) -> TernGrad:
        strategy = build_strategy(cfg, cfg.model_factory())
        assert isinstance(strategy, TernGrad)
        screen = strategy._screen

        def logged_screen(item: Any, report: Any) -> Any:
            log.append("screen")
            return screen(item, report)

        strategy._screen = logged_screen  # type: ignore[method-assign]
        strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=3)
        return strategy

    log: list[str] = []
    streamed = run(_OneByOne(make_client_app(cfg), 4))
    assert log[:4] == ["arrive 0", "screen", "arrive 1", "screen"]
    log.clear()
    listed = run(InlineGrid(make_client_app(cfg), 4))
    assert streamed.shadow.fingerprint() == listed.shadow.fingerprint()  # same trajectory
    assert [r.accepted for r in streamed.reports] == [r.accepted for r in listed.reports]
