"""Flower-free gradient compression: TernGrad ternary codes at 2 bits per value.

Usage::

    from fedddl.compression import TernaryCompressor, ResidualMemory, encode_update, decode_update
    data = encode_update(model_gradients, TernaryCompressor(seed=0), ResidualMemory())
    grads = decode_update(data)      # raises PayloadError on bad input
    grads = decode_update(data, **limits_for(model_gradients))  # a model over the defaults

Three layers, imports pointing one way (``backends`` <- ``algorithms`` <- ``codecs``):
:mod:`.backends` (numpy, numba, torch and thread kernels), :mod:`.algorithms`
(compressors, memories, payloads, the registry), :mod:`.codecs` (the update message,
downlink formats, entropy coding). This module re-exports the public API.
"""

from fedddl.compression.algorithms.base import Compressor
from fedddl.compression.algorithms.identity import IdentityCompressor
from fedddl.compression.algorithms.memory import Memory, NoMemory, ResidualMemory
from fedddl.compression.algorithms.payload import (
    SUPPORTED_DTYPES,
    Context,
    DensePayload,
    Payload,
    TernaryPayload,
)
from fedddl.compression.algorithms.quinary_projected import QuinaryProjectedCompressor
from fedddl.compression.algorithms.registry import (
    available_compressors,
    get_compressor,
    is_ternary,
    make_compressor,
    register_compressor,
    takes_scale_bucket,
)
from fedddl.compression.algorithms.sharing import local_scales, max_scales
from fedddl.compression.algorithms.ternary import TernaryCompressor, TernaryEntropyCompressor
from fedddl.compression.backends.packing import CODECS, pack_codes
from fedddl.compression.backends.ternarize import PROBABILITY_BITS
from fedddl.compression.backends.unpacking import unpack_codes
from fedddl.compression.codecs.errors import PayloadError, PayloadLimitError
from fedddl.compression.codecs.message_buffer import MessageBuffer
from fedddl.compression.codecs.wire import (
    BUCKETS_VERSION,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_TENSORS,
    DEFAULT_MAX_VALUES,
    FORMAT_VERSION,
    MAGIC,
    DecodeLimits,
    EntryHeader,
    OpenedMessage,
    decode_update,
    encode_update,
    limits_for,
    open_message,
    read_header,
)
from fedddl.compression.warmup import warm_up

__all__ = [
    "BUCKETS_VERSION",
    "CODECS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_TENSORS",
    "DEFAULT_MAX_VALUES",
    "FORMAT_VERSION",
    "MAGIC",
    "PROBABILITY_BITS",
    "SUPPORTED_DTYPES",
    "Compressor",
    "Context",
    "DecodeLimits",
    "DensePayload",
    "EntryHeader",
    "IdentityCompressor",
    "Memory",
    "MessageBuffer",
    "NoMemory",
    "OpenedMessage",
    "Payload",
    "PayloadError",
    "PayloadLimitError",
    "QuinaryProjectedCompressor",
    "ResidualMemory",
    "TernaryCompressor",
    "TernaryEntropyCompressor",
    "TernaryPayload",
    "available_compressors",
    "decode_update",
    "encode_update",
    "get_compressor",
    "is_ternary",
    "limits_for",
    "local_scales",
    "make_compressor",
    "max_scales",
    "open_message",
    "pack_codes",
    "read_header",
    "register_compressor",
    "takes_scale_bucket",
    "unpack_codes",
    "warm_up",
]
