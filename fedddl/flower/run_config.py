"""Run-config overrides in Flower's own syntax (``flwr run --run-config``).

``parse_run_config(["num-server-rounds=5 strategy='fedavg'"])`` returns
``{"num-server-rounds": 5, "strategy": "fedavg"}``, parsed by Flower's
:func:`flwr.common.config.parse_config_args`: space-separated ``key=value`` pairs whose
values are TOML (strings in quotes, ``true``/``false``, numbers), or the path of one
``.toml`` file. Unlike Flower, text that is not a ``key=value`` pair is an error instead
of being skipped silently.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import click
from flwr.common.config import parse_config_args

__all__ = ["parse_run_config"]

# The pattern Flower's parser matches (flwr.common.config.parse_config_args, Flower 1.42).
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def parse_run_config(texts: Sequence[str]) -> dict[str, Any]:
    """Parse ``--run-config`` arguments into a flat ``{key: value}`` dict.

    Parameters
    ----------
    texts : sequence of str
        Each a space-separated list of ``key=value`` pairs (later ones win), or a
        single ``.toml`` path.

    Returns
    -------
    dict
        Kebab-case keys (nested TOML tables flattened with ``.``) to values.

    Raises
    ------
    ValueError
        Naming the text that is not a ``key=value`` pair, or Flower's message for
        a value that is not valid TOML (e.g. an unquoted string).
    """
    items = [t for t in texts if t.strip()]
    for text in items:
        if text.strip().endswith(".toml"):
            continue
        leftover = _PAIR.sub("", text).strip()
        if leftover:
            raise ValueError(
                f"run config: {leftover!r} is not a key=value pair "
                "(expected e.g. \"num-server-rounds=5 strategy='fedavg'\")"
            )
    try:
        return parse_config_args(items)
    except click.ClickException as err:
        raise ValueError(f"run config {' '.join(items)!r}: {err.message}") from err
    except (OSError, ValueError) as err:
        raise ValueError(f"run config {' '.join(items)!r}: {err}") from err
