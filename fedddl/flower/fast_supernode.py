"""Run ``flower-supernode`` with a shorter message poll interval (opt-in).

Flower 1.42's SuperNode main loop (``flwr.supernode.start_client_internal``)
sleeps a hard-coded 3 s whenever a pull found no message, and 0.5 s while
waiting for the ClientApp's reply. A message that arrives just after a pull
therefore waits up to 3 s (1.5 s on average) before the SuperNode sees it; a
train + evaluate round pays that twice. There is no flag or environment
variable for it, so this launcher replaces the ``time`` module *inside that
one module* with a proxy whose ``sleep(3)`` / ``sleep(0.5)`` last
``--poll-interval`` / ``--reply-poll-interval`` seconds, then runs the normal
``flower-supernode`` entry point with the remaining arguments::

    python -m fedddl.flower.fast_supernode --poll-interval 0.2 -- \\
        --superlink 10.0.0.1:8000 --root-certificates ca.crt ...

It also retries the pull of a message's objects that have not reached the
SuperLink yet within 0.2 s instead of Flower's 1-10 s (:mod:`fedddl.flower.object_pull`),
and gives the Fleet API requests a ``--fleet-timeout`` of 300 s instead of Flower's 30 s, so
a large object's push survives a slow shared link (:mod:`fedddl.flower.fleet_timeout`).

Trade-off: an idle SuperNode sends one pull request per interval (5/s at
0.2 s instead of 1/3 s). The patch is checked against the pinned Flower
version and refuses to run on a module that no longer looks as expected.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from fedddl.flower.fleet_timeout import FLEET_TIMEOUT_S, patch_fleet_timeout
from fedddl.flower.heartbeat_patience import patch_heartbeat_patience
from fedddl.flower.object_pull import SUPERNODE, patch_object_pulls

__all__ = ["ScaledSleepTime", "main", "patch_supernode_polling"]

_IDLE_POLL_S = 3.0
_REPLY_POLL_S = 0.5


class ScaledSleepTime:
    """Stand-in for the ``time`` module with two sleep durations replaced.

    Parameters
    ----------
    replacements : dict
        Original sleep duration (seconds) -> duration to sleep instead.
    """

    def __init__(self, replacements: dict[float, float]) -> None:
        self.replacements = dict(replacements)

    def sleep(self, seconds: float) -> None:
        """Sleep the replacement for ``seconds`` if one is set, else ``seconds``."""
        time.sleep(self.replacements.get(float(seconds), seconds))

    def __getattr__(self, name: str) -> Any:
        # Everything else (time.time, time.monotonic, ...) is the real thing.
        return getattr(time, name)


def patch_supernode_polling(poll_interval_s: float, reply_poll_interval_s: float) -> ModuleType:
    """Shorten the SuperNode's idle poll and reply wait; return the patched module.

    Raises
    ------
    RuntimeError
        If the Flower module does not have the structure this patch expects.
    ValueError
        If an interval is not positive.
    """
    if poll_interval_s <= 0 or reply_poll_interval_s <= 0:
        raise ValueError("poll intervals must be positive")
    import inspect

    from flwr.supernode import start_client_internal as module

    source = inspect.getsource(module)
    if getattr(module, "time", None) is not time or "time.sleep(3)" not in source:
        raise RuntimeError(
            "flwr.supernode.start_client_internal does not look like Flower 1.42's "
            "(no module-level `time` with a `time.sleep(3)` poll); not patching"
        )
    # setattr: the module does not declare `time` as public API.
    setattr(  # noqa: B010
        module, "time",
        ScaledSleepTime({_IDLE_POLL_S: poll_interval_s, _REPLY_POLL_S: reply_poll_interval_s}),
    )
    return module


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the launcher options, patch, and run ``flower-supernode`` with the rest."""
    parser = argparse.ArgumentParser(
        prog="python -m fedddl.flower.fast_supernode",
        description="flower-supernode with a configurable message poll interval",
    )
    parser.add_argument("--poll-interval", type=float, default=0.2,
                        help="seconds between pulls while idle (Flower: 3)")
    parser.add_argument("--reply-poll-interval", type=float, default=0.05,
                        help="seconds between checks for the ClientApp's reply (Flower: 0.5)")
    parser.add_argument("--heartbeat-patience", type=int, default=None,
                        help="missed 30 s heartbeats tolerated before a ClientApp counts as "
                             "stopped (Flower: 2; fedddl.flower.heartbeat_patience)")
    parser.add_argument("--fleet-timeout", type=float, default=FLEET_TIMEOUT_S,
                        help="seconds one Fleet API request (e.g. pushing one tensor) may take "
                             f"(default {FLEET_TIMEOUT_S:g}; Flower: 30)")
    parser.add_argument("supernode_args", nargs=argparse.REMAINDER,
                        help="arguments for flower-supernode (after --)")
    args = parser.parse_args(argv)
    rest = list(args.supernode_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    patch_supernode_polling(args.poll_interval, args.reply_poll_interval)
    patch_object_pulls(SUPERNODE)
    patch_fleet_timeout(args.fleet_timeout)
    if args.heartbeat_patience is not None:
        patch_heartbeat_patience(args.heartbeat_patience)
    print(f"fedddl: SuperNode message poll {args.poll_interval} s, reply poll "
          f"{args.reply_poll_interval} s (Flower: 3 s / 0.5 s)", file=sys.stderr, flush=True)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
