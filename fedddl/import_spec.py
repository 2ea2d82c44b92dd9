"""Resolve a user's ``"package.module:attribute"`` spec (own model, dataset or strategy).

One place for the parsing, the import and their error messages; each caller checks that
the attribute is what it needs (a callable, a Strategy subclass, ...).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_attribute"]


def import_attribute(spec: str, what: str, example: str) -> tuple[Any, str, str]:
    """Return ``(attribute or None, module name, attribute name)`` for ``spec``.

    ``what`` names the setting in the messages (``"model"``); ``example`` shows the
    expected shape (``"package.module:factory"``).

    Raises
    ------
    ValueError
        If ``spec`` is not ``module:attribute`` or the module cannot be imported.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must look like {example!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: {err}") from err
    return getattr(module, attr, None), module_name, attr
