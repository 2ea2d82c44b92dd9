"""The ``fedddl`` command line.

Each subcommand lives in its own module under :mod:`fedddl.commands` and
exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are discovered at start-up, so adding a command is adding one file.
Command modules keep heavy imports (torch, flwr) inside ``run`` so that
``fedddl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from fedddl import __version__, commands


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to the help of every option that takes a value.

    Switches (``store_true``/``store_false``) are off unless given, and options whose
    default is ``None``, empty or a list say in their own help what happens without them.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text.lower()
            or not action.option_strings
            or action.nargs == 0
            or action.default in (None, "", argparse.SUPPRESS)
            or action.default == []
        ):
            return text
        return f"{text} (default: %(default)s)"


def _command_modules() -> list[ModuleType]:
    modules = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        modules.append(importlib.import_module(f"{commands.__name__}.{info.name}"))
    return modules


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with one sub-parser per command module."""
    parser = argparse.ArgumentParser(
        prog="fedddl",
        description="Communication-efficient distributed deep learning on Flower.",
    )
    parser.add_argument("--version", action="version", version=f"fedddl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        cmd = sub.add_parser(
            module.NAME, help=module.HELP, description=module.HELP, formatter_class=HelpFormatter
        )
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedddl`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 0
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
