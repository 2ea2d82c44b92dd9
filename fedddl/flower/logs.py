"""Route the Flower-free core's log records (logger ``"fedddl"``) to Flower's logger.

The core modules log through ``logging.getLogger("fedddl")`` and know nothing about
Flower; inside a Flower app their records belong next to Flower's own, with its console
format and its log files. :func:`use_flower_logging` (idempotent) forwards them.
"""

from __future__ import annotations

import logging

from flwr.common.logger import FLOWER_LOGGER

__all__ = ["use_flower_logging"]


class _ToFlower(logging.Handler):
    """Hand every record to Flower's logger."""

    def emit(self, record: logging.LogRecord) -> None:
        FLOWER_LOGGER.handle(record)


def use_flower_logging(level: int = logging.INFO) -> None:
    """Forward records of the ``"fedddl"`` logger at ``level`` and above to Flower's."""
    core = logging.getLogger("fedddl")
    if not any(isinstance(h, _ToFlower) for h in core.handlers):
        core.addHandler(_ToFlower())
    core.setLevel(level)
    core.propagate = False
