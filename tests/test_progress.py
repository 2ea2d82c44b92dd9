"""The progress display: a bar with time left on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

import pytest

from fedddl.progress import Progress, report


def test_plain_lines_without_a_terminal() -> None:
    stream = io.StringIO()
    with Progress(3, "job", unit="rounds", stream=stream) as progress:
        assert not progress.terminal  # a StringIO is no terminal
        for k in (1, 2, 3):
            report(progress, f"round {k}/3", done=k)
    assert stream.getvalue() == "round 1/3\nround 2/3\nround 3/3\n"
    assert progress.done == 3


def test_bar_with_time_left_on_a_terminal() -> None:
    stream = io.StringIO()
    with Progress(4, "fedddl simulate", unit="rounds", stream=stream, terminal=True) as progress:
        report(progress, "round 1/4: acc=0.5", done=1)
        report(progress, "round 2/4: acc=0.7", done=2)
    out = stream.getvalue()
    assert "round 1/4: acc=0.5" in out and "round 2/4: acc=0.7" in out
    assert "fedddl simulate" in out and "2/4" in out and "rounds" in out
    assert "left" in out and "━" in out  # the bar and its time-left column
    assert "\x1b[" in out  # drawn with terminal control codes


def test_fractional_totals_and_clamping() -> None:
    stream = io.StringIO()
    with Progress(2.5, "gossip", unit="virtual s", stream=stream, terminal=True) as progress:
        progress.update(1.25, "t=1.25")
        progress.update(9.0)  # past the end: clamped
    assert progress.done == 2.5
    assert "2.5/2.5" in stream.getvalue()


def test_report_to_plain_callables_and_none() -> None:
    lines: list[str] = []
    report(lines.append, "a", done=1)
    report(None, "b", done=2)
    assert lines == ["a"]


def test_total_must_be_positive() -> None:
    with pytest.raises(ValueError, match="total"):
        Progress(0, "x")
