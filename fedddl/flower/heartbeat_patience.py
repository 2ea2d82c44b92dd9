"""Give Flower's tasks and nodes more missed heartbeats before they count as gone (opt-in).

Flower 1.42 ends a ServerApp's run, and answers a ClientApp's message with "ClientApp
stopped responding", when the process sent no heartbeat for ``HEARTBEAT_PATIENCE`` (2) x
30 s; a SuperNode missing as long counts as offline. On a machine whose processes stall
for that long (two cores shared by many jobs, memory short, 45 MB messages) healthy runs
are ended. :func:`patch_heartbeat_patience` raises the patience inside the SuperLink's or
SuperNode's process (the modules that read it); ``python -m
fedddl.flower.heartbeat_patience --patience N -- ARGS`` runs ``flower-superlink ARGS``
patched. The patch refuses Flower modules without the constant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["MODULES", "main", "patch_heartbeat_patience"]

#: The Flower modules whose ``HEARTBEAT_PATIENCE`` decides when a task or node is gone.
MODULES = (
    "flwr.supercore.corestate.in_memory_corestate",
    "flwr.server.superlink.linkstate.in_memory_linkstate",
    "flwr.server.superlink.linkstate.sql_linkstate",
)


def patch_heartbeat_patience(patience: int) -> list[str]:
    """Set ``HEARTBEAT_PATIENCE`` to ``patience`` in :data:`MODULES`; return their names.

    Raises
    ------
    ValueError
        If ``patience`` < 1.
    RuntimeError
        If a module does not define ``HEARTBEAT_PATIENCE`` (not Flower 1.42's layout).
    """
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        raise ValueError(f"heartbeat patience must be an int >= 1, got {patience!r}")
    modules = [importlib.import_module(name) for name in MODULES]
    for module in modules:
        if not isinstance(getattr(module, "HEARTBEAT_PATIENCE", None), int):
            raise RuntimeError(f"{module.__name__} has no HEARTBEAT_PATIENCE; not patching")
    for module in modules:
        setattr(module, "HEARTBEAT_PATIENCE", patience)  # noqa: B010
    return [module.__name__ for module in modules]


def main(argv: Sequence[str] | None = None) -> int:
    """Patch, then run ``flower-superlink`` with the arguments after ``--``."""
    parser = argparse.ArgumentParser(prog="python -m fedddl.flower.heartbeat_patience",
                                     description="flower-superlink with more heartbeat patience")
    parser.add_argument("--patience", type=int, required=True,
                        help="missed 30 s heartbeats tolerated (Flower: 2)")
    parser.add_argument("superlink_args", nargs=argparse.REMAINDER,
                        help="arguments for flower-superlink (after --)")
    args = parser.parse_args(argv)
    rest = list(args.superlink_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    patch_heartbeat_patience(args.patience)
    print(f"fedddl: heartbeat patience {args.patience} x 30 s (Flower: 2)", file=sys.stderr,
          flush=True)
    from flwr.superlink.cli.flower_superlink import flower_superlink

    sys.argv = ["flower-superlink", *rest]
    flower_superlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
