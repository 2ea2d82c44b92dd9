"""Progress of long commands: a bar with time left on a terminal, plain lines otherwise.

Producers (the gossip simulator, the ServerApp's round recorder, the experiment driver)
take a progress callback ``progress(line)`` and call :func:`report` with how far they
are. A plain callable (``print``, a logger) just gets the line; a :class:`Progress`
also moves its bar::

    with Progress(total=200, description="fedddl simulate", unit="rounds") as progress:
        run(..., progress=progress)       # the producer calls report(progress, line, done=k)

On a terminal (``rich``, which Flower installs) the lines scroll above one bar showing
done/total, elapsed time and time left; otherwise (a file, a pipe, CI logs) every line
is printed as it is, so logs stay greppable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress", "ProgressFn", "report"]

ProgressFn = Callable[[str], None]


class Progress:
    """A progress display for ``total`` units of work.

    Parameters
    ----------
    total : float
        Units of the whole job (rounds, virtual seconds, runs).
    description : str
        Label in front of the bar.
    unit : str
        Name of the unit, shown after ``done/total``.
    stream : TextIO, optional
        Where lines go (default: ``sys.stderr``).
    terminal : bool, optional
        Force the bar on (``True``) or off (``False``); default: whether ``stream`` is
        a terminal.
    """

    def __init__(
        self,
        total: float,
        description: str,
        *,
        unit: str = "",
        stream: TextIO | None = None,
        terminal: bool | None = None,
    ) -> None:
        if not total > 0:
            raise ValueError(f"total must be > 0, got {total}")
        self.total = float(total)
        self.description = description
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty()) if terminal is None and isatty else bool(terminal)
        self.done = 0.0
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        """Start the bar (on a terminal)."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop the bar, leaving its last state on screen."""
        self.close()

    def start(self) -> None:
        """Show the bar now (nothing happens without a terminal)."""
        if not self.terminal or self._bar is not None:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        console = Console(file=self.stream, force_terminal=True)
        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn() if self.total.is_integer() else _done_column(),
            TextColumn(self.unit),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=console,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task = self._bar.add_task(self.description, total=self.total)
        self._bar.start()

    def close(self) -> None:
        """Stop the bar; idempotent."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __call__(self, line: str) -> None:
        """Print one line (above the bar on a terminal)."""
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def update(self, done: float, line: str | None = None) -> None:
        """Set the work done to ``done`` units (clamped to the total) and print ``line``."""
        self.done = min(max(float(done), 0.0), self.total)
        if self.terminal and self._bar is None:
            self.start()
        if line is not None:
            self(line)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def advance(self, units: float = 1.0, line: str | None = None) -> None:
        """Add ``units`` of work done and print ``line``."""
        self.update(self.done + units, line)


def _done_column() -> Any:
    """``done/total`` with one decimal, for fractional totals (e.g. virtual seconds)."""
    from rich.progress import TextColumn

    return TextColumn("{task.completed:.1f}/{task.total:.1f}")


def report(progress: ProgressFn | None, line: str, *, done: float | None = None) -> None:
    """Hand ``line`` to ``progress``; a :class:`Progress` also moves to ``done`` units."""
    if progress is None:
        return
    if isinstance(progress, Progress) and done is not None:
        progress.update(done, line)
    else:
        progress(line)
