"""Flower-free gradient compression: TernGrad ternary codes at 2 bits per value.

Usage::

    from fedddl.compression import TernaryCompressor, ResidualMemory, encode_update, decode_update
    data = encode_update(model_gradients, TernaryCompressor(seed=0), ResidualMemory())
    grads = decode_update(data)      # raises PayloadError on bad input
"""

from fedddl.compression.base import Compressor
from fedddl.compression.errors import PayloadError
from fedddl.compression.identity import IdentityCompressor
from fedddl.compression.memory import Memory, NoMemory, ResidualMemory
from fedddl.compression.message_buffer import MessageBuffer
from fedddl.compression.packing import CODECS, pack_codes, unpack_codes
from fedddl.compression.payload import (
    SUPPORTED_DTYPES,
    Context,
    DensePayload,
    Payload,
    TernaryPayload,
)
from fedddl.compression.registry import (
    available_compressors,
    get_compressor,
    is_ternary,
    make_compressor,
    register_compressor,
)
from fedddl.compression.sharing import local_scales, max_scales
from fedddl.compression.ternarize import PROBABILITY_BITS
from fedddl.compression.ternary import TernaryCompressor, TernaryEntropyCompressor
from fedddl.compression.wire import (
    FORMAT_VERSION,
    MAGIC,
    EntryHeader,
    OpenedMessage,
    decode_update,
    encode_update,
    open_message,
    read_header,
)

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "MAGIC",
    "PROBABILITY_BITS",
    "SUPPORTED_DTYPES",
    "Compressor",
    "Context",
    "DensePayload",
    "EntryHeader",
    "IdentityCompressor",
    "Memory",
    "MessageBuffer",
    "NoMemory",
    "OpenedMessage",
    "Payload",
    "PayloadError",
    "ResidualMemory",
    "TernaryCompressor",
    "TernaryEntropyCompressor",
    "TernaryPayload",
    "available_compressors",
    "decode_update",
    "encode_update",
    "get_compressor",
    "is_ternary",
    "local_scales",
    "make_compressor",
    "max_scales",
    "open_message",
    "pack_codes",
    "read_header",
    "register_compressor",
    "unpack_codes",
]
