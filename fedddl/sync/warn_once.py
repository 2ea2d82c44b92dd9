"""The log level for a repeated notice: WARNING the first time per key, DEBUG after."""

from __future__ import annotations

import logging
from collections.abc import Hashable

__all__ = ["WarnOnce"]


class WarnOnce:
    """Remembers which keys (e.g. node ids) were already logged at WARNING."""

    def __init__(self) -> None:
        self._warned: set[Hashable] = set()

    def level(self, key: Hashable) -> int:
        """``logging.WARNING`` the first time ``key`` is seen, ``logging.DEBUG`` after."""
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        return level
