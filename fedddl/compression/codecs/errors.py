"""The one exception type raised when an encoded update cannot be decoded."""

from __future__ import annotations

__all__ = ["PayloadError", "PayloadLimitError"]


class PayloadError(ValueError):
    """An encoded update is malformed, truncated, corrupted or hostile.

    :func:`fedddl.compression.decode_update` raises only this type for bad
    input, and its message names the problem (truncation, wrong magic or
    version, CRC mismatch, invalid code, shape/length mismatch, non-finite
    scale, repeated name, unknown dtype, trailing bytes, ...); a message over a
    decoder's limits raises the subclass :class:`PayloadLimitError`.
    """


class PayloadLimitError(PayloadError):
    """An encoded update declares more tensors, values or bytes than the decoder's limit
    (its message names the limit and the keyword that raises it)."""
