"""The decoders' default limits: how many tensors, values and bytes a message may declare
before anything is allocated or decompressed for it.

Every public decoder refuses a message over its limits with a
:class:`~fedddl.compression.PayloadError` naming the limit and the keyword that raises it.
The defaults fit real models (ResNet-18: 62 parameter tensors, 11.2 M values) with room to
spare; a caller that knows its model passes that model's layout instead
(``decode_update(data, **limits_for(model))``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypedDict

import torch

from fedddl.compression.codecs.errors import PayloadLimitError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_TENSORS",
    "DEFAULT_MAX_VALUES",
    "DecodeLimits",
    "check_limit",
    "limits_for",
]

#: Tensors a message may declare unless the caller passes ``max_tensors``.
DEFAULT_MAX_TENSORS = 4096
#: Values (the sum of every tensor's element count) unless the caller passes ``max_values``.
DEFAULT_MAX_VALUES = 1 << 26
#: Bytes of a message (and of an entropy-coded message's body) unless the caller passes
#: ``max_bytes``: room for :data:`DEFAULT_MAX_VALUES` float64 values and their headers.
DEFAULT_MAX_BYTES = 1 << 30


class DecodeLimits(TypedDict):
    """The keyword arguments that bound a decoder to one model's layout."""

    max_tensors: int
    max_values: int


def limits_for(tensors: Mapping[str, torch.Tensor]) -> DecodeLimits:
    """The limits a message describing exactly ``tensors`` needs: their count and values."""
    return {
        "max_tensors": len(tensors),
        "max_values": sum(math.prod(t.shape) for t in tensors.values()),
    }


def check_limit(declared: int, limit: int, what: str, keyword: str) -> None:
    """Refuse ``declared`` ``what`` over ``limit``, saying which keyword raises the limit.

    Raises
    ------
    PayloadLimitError
        If ``declared > limit``.
    """
    if declared > limit:
        raise PayloadLimitError(
            f"message declares {declared} {what}, at most {limit} expected "
            f"(the limit {keyword}={limit}; pass a larger {keyword}= to accept more)"
        )
