"""Moved to :mod:`fedddl.flower.grid` (this path keeps working for one release)."""

from __future__ import annotations

from fedddl.flower.grid import DEFAULT_POLL_INTERVAL_S, FastPollGrid

__all__ = ["DEFAULT_POLL_INTERVAL_S", "FastPollGrid"]
