"""The update message: ``encode_update`` / ``decode_update``, and reading a header
(``read_header``, ``open_message``) before deciding to decode.

:mod:`.layout` holds the byte layout; :mod:`.encode` writes it, :mod:`.header` checks it,
:mod:`.decode` turns checked data into tensors, :mod:`.opened` keeps what was checked.
Every malformed message, and one over the decoder's limits
(:mod:`fedddl.compression.codecs.limits`), is a :class:`~fedddl.compression.PayloadError`.
"""

from fedddl.compression.codecs.limits import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_TENSORS,
    DEFAULT_MAX_VALUES,
    DecodeLimits,
    limits_for,
)
from fedddl.compression.codecs.wire.decode import decode_update
from fedddl.compression.codecs.wire.encode import encode_update
from fedddl.compression.codecs.wire.layout import (
    BUCKETS_VERSION,
    FORMAT_VERSION,
    MAGIC,
    MAX_DIM,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_TENSORS,
)
from fedddl.compression.codecs.wire.opened import (
    EntryHeader,
    OpenedMessage,
    decode_small_batch,
    open_message,
    read_header,
)

__all__ = [
    "BUCKETS_VERSION",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_TENSORS",
    "DEFAULT_MAX_VALUES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_DIM",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "MAX_TENSORS",
    "DecodeLimits",
    "EntryHeader",
    "OpenedMessage",
    "decode_small_batch",
    "decode_update",
    "encode_update",
    "limits_for",
    "open_message",
    "read_header",
]
