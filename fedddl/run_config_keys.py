"""Kebab-case keys of a Flower ``run_config``: naming, unknown-key hints, value coercion."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

__all__ = ["coerce", "kebab", "unknown_key_message"]


def kebab(name: str) -> str:
    """The run-config key of the field ``name`` (``_`` becomes ``-``)."""
    return name.replace("_", "-")


def unknown_key_message(key: str, known: Mapping[str, Any]) -> str:
    """``unknown config key 'x'; did you mean 'y'?`` plus the known keys."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.4)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {key!r}{hint} (known keys: {', '.join(sorted(known))})"


def coerce(key: str, value: Any, default: Any) -> Any:
    """Convert ``value`` to the type of ``default``; raise ``ValueError`` naming ``key``."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"config key {key!r} must be a boolean, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"config key {key!r} must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"config key {key!r} must be an integer, got {value!r}") from None
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"config key {key!r} must be a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"config key {key!r} must be a number, got {value!r}") from None
    if not isinstance(value, str):
        raise ValueError(f"config key {key!r} must be a string, got {value!r}")
    return value
