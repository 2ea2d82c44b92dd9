"""JSON that stays JSON: non-finite floats become ``null``.

``json.dumps`` writes ``NaN`` and ``Infinity``, which are not JSON: a results file with a
loss of ``inf`` (a diverged model, or a client's lie that got through) would not load in
strict parsers. :func:`finite_json` replaces every non-finite float by None.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite_json"]


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value
