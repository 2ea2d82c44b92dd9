"""Subcommands of the ``fedddl`` CLI, one module each (see :mod:`fedddl.cli`)."""
