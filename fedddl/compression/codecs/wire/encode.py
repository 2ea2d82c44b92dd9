"""``encode_update``: compress and serialise named tensors into one message
(layout: :mod:`fedddl.compression.codecs.wire.layout`)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, NoReturn, overload

import torch

from fedddl.compression.algorithms.base import Compressor
from fedddl.compression.algorithms.identity import IdentityCompressor
from fedddl.compression.algorithms.memory import Memory
from fedddl.compression.algorithms.payload import (
    Context,
    DensePayload,
    Payload,
    TernaryPayload,
)
from fedddl.compression.backends.device_path import to_host
from fedddl.compression.backends.packing import (
    packed_size,
)
from fedddl.compression.codecs.entropy import seal_entropy_coded
from fedddl.compression.codecs.message_buffer import MessageBuffer, NonFiniteValues
from fedddl.compression.codecs.wire.layout import (
    BUCKET_KIND_OF_CODEC,
    BUCKETS_VERSION,
    COUNT,
    DTYPE_CODES,
    FORMAT_VERSION,
    KIND_DENSE,
    KIND_OF_CODEC,
    MAGIC,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_TENSORS,
    PREFIX,
)
from fedddl.framing import CRC, crc32_of

__all__ = ["encode_update"]

def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":  # e.g. a plug-in compressor's dense payload on a GPU
        flat = to_host(flat)
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _entry_header(name: str, payload: Payload, ctx: Context) -> bytes:
    name_bytes = name.encode("utf-8")
    if len(name_bytes) > MAX_NAME_BYTES:
        raise ValueError(f"tensor name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
    if len(ctx.shape) > MAX_NDIM:
        raise ValueError(f"tensor {name!r} has {len(ctx.shape)} > {MAX_NDIM} dimensions")
    if ctx.dtype not in DTYPE_CODES:
        raise ValueError(f"tensor {name!r} has unsupported dtype {ctx.dtype}")
    if isinstance(payload, DensePayload):
        kind = KIND_DENSE
    elif payload.bucket:
        kind = BUCKET_KIND_OF_CODEC[payload.codec]
    else:
        kind = KIND_OF_CODEC[payload.codec]
    parts = [
        struct.pack("<H", len(name_bytes)),
        name_bytes,
        struct.pack("<BBB", DTYPE_CODES[ctx.dtype], kind, len(ctx.shape)),
        struct.pack(f"<{len(ctx.shape)}Q", *ctx.shape),
    ]
    if isinstance(payload, TernaryPayload):
        parts.append(struct.pack("<f", payload.scale))
        if payload.bucket:
            parts.append(struct.pack("<I", payload.bucket))
    return b"".join(parts)


def _entry_data(name: str, payload: Payload, ctx: Context) -> memoryview:
    if isinstance(payload, DensePayload):
        if tuple(payload.values.shape) != ctx.shape or payload.values.dtype != ctx.dtype:
            raise ValueError(f"tensor {name!r}: dense payload does not match its context")
        return _raw_bytes(payload.values)
    if payload.numel != ctx.numel or payload.codes.numel() != packed_size(
        payload.numel, payload.codec
    ):
        raise ValueError(f"tensor {name!r}: ternary payload size does not match its context")
    if payload.bucket:  # the bucket scales (float32, little-endian), then the codes
        assert payload.bucket_scales is not None  # TernaryPayload checks it
        scales = payload.bucket_scales.detach().cpu().numpy().astype("<f4").tobytes()
        return memoryview(scales + bytes(_raw_bytes(payload.codes)))
    return _raw_bytes(payload.codes)


def _raise_named(name: str, error: ValueError | TypeError) -> NoReturn:
    """Re-raise ``error`` prefixed with the tensor's name (as it is if it names it)."""
    if str(error).startswith(f"tensor {name!r}"):
        raise error
    kind = ValueError if isinstance(error, ValueError) else TypeError
    raise kind(f"tensor {name!r}: {error}") from error


@contextmanager
def _naming(name: str) -> Iterator[None]:
    """Prefix a ``ValueError`` / ``TypeError`` raised inside with the tensor's name."""
    try:
        yield
    except (ValueError, TypeError) as error:
        _raise_named(name, error)


@overload
def encode_update(
    named_tensors: Mapping[str, torch.Tensor],
    compressor: Compressor,
    memory: Memory | None = None,
    *,
    scales: Mapping[str, float] | None = None,
    clamp: bool = False,
    dense: Collection[str] = (),
    into: None = None,
) -> bytes: ...


@overload
def encode_update(
    named_tensors: Mapping[str, torch.Tensor],
    compressor: Compressor,
    memory: Memory | None = None,
    *,
    scales: Mapping[str, float] | None = None,
    clamp: bool = False,
    dense: Collection[str] = (),
    into: MessageBuffer,
) -> bytes | memoryview: ...


def encode_update(
    named_tensors: Mapping[str, torch.Tensor],
    compressor: Compressor,
    memory: Memory | None = None,
    *,
    scales: Mapping[str, float] | None = None,
    clamp: bool = False,
    dense: Collection[str] = (),
    into: MessageBuffer | None = None,
) -> bytes | memoryview:
    """Compress and serialise ``named_tensors`` into one message.

    Parameters
    ----------
    named_tensors:
        Tensors by name (encoded in the mapping's order).
    compressor:
        Any :class:`Compressor`.
    memory:
        Error-feedback memory: each tensor is ``memory.compensate``-d before
        compression and ``memory.update``-d after, but only once every tensor
        compressed successfully (a failure leaves the memory unchanged).
    scales:
        Optional shared scalers by name, passed to ``compressor.compress(scale=)``.
    clamp:
        With ``scales``: clamp each compensated tensor to ``[-scale, scale]`` before
        compressing it (scaler sharing with scales agreed in an earlier round, which may
        lie below this tensor's own). The memory then keeps what the clamp cut off too.

    dense:
        Names of tensors sent in fp32 (their own dtype) instead of through ``compressor``
        (TernGrad's exemptions: small tensors, the logits layer).
    into:
        Write the message into this reused buffer and return a view of it (valid until
        the next message written into the buffer) instead of new ``bytes``: no page
        faults for a fresh large message (:mod:`fedddl.compression.codecs.message_buffer`).
        Entropy-coded messages are new ``bytes`` either way.

    The order is fixed here, in one place: compensate, clamp, compress, update the
    memory, serialise.

    Returns
    -------
    bytes or memoryview
        The message (layout: :mod:`.layout`): ``bytes``, or a view of ``into``.

    Raises
    ------
    ValueError
        Naming the tensor: non-finite values, bad scale, name too long, ...
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a Compressor, got {type(compressor).__name__}")
    if len(named_tensors) > MAX_TENSORS:
        raise ValueError(f"{len(named_tensors)} tensors exceed the limit of {MAX_TENSORS}")
    unknown = set(scales or {}) - set(named_tensors)
    if unknown:
        raise ValueError(f"scales given for unknown tensors: {sorted(unknown)}")
    names: list[str] = []
    compensated: list[torch.Tensor] = []
    for name, tensor in named_tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if memory is None:
            compensated.append(tensor)
        else:
            with _naming(name):
                compensated.append(memory.compensate(name, tensor))
        names.append(name)
    shared = [None if scales is None else scales.get(name) for name in names]
    inputs = compensated
    if clamp:
        inputs = [
            t if s is None else t.clamp(-s, s) for t, s in zip(compensated, shared, strict=True)
        ]
    exempt = set(dense) & set(names)
    # the fp32 codec into a buffer: float32 values are checked finite while they are copied
    fused_check = into is not None and memory is None and isinstance(compressor, IdentityCompressor)
    if exempt:
        compressed = _compress_split(names, inputs, shared, compressor, exempt)
    elif fused_check:
        assert isinstance(compressor, IdentityCompressor)
        batch = partial(compressor.compress_batch, defer_float32_check=True)
        compressed = _compress_all(names, inputs, shared, compressor, batch)
    else:
        compressed = _compress_all(names, inputs, shared, compressor)
    bucketed = any(isinstance(p, TernaryPayload) and p.bucket for p, _ in compressed)
    if bucketed and compressor.entropy_coding:
        raise ValueError("entropy-coded messages carry one scale per tensor, not scale buckets")
    headers: list[bytes] = []
    data: list[memoryview] = []
    pending: list[tuple[str, torch.Tensor, Payload, Context]] = []
    name = ""
    try:  # one handler for the loop (a context manager per tensor costs more than framing)
        for name, tensor, (payload, ctx) in zip(names, compensated, compressed, strict=True):
            headers.append(_entry_header(name, payload, ctx))
            data.append(_entry_data(name, payload, ctx))
            pending.append((name, tensor, payload, ctx))
    except (ValueError, TypeError) as error:
        _raise_named(name, error)
    if memory is not None:
        updates = [
            (name, tensor, compressor.decompress(payload, ctx))
            for name, tensor, payload, ctx in pending
        ]
        for name, tensor, decompressed in updates:
            memory.update(name, tensor, decompressed)
    body_length = sum(len(h) for h in headers) + sum(d.nbytes for d in data)
    total = PREFIX.size + body_length + CRC.size
    if compressor.entropy_coding == "zstd":
        coded = seal_entropy_coded([COUNT.pack(len(headers)), *headers, *data], total)
        if coded is not None:
            return coded
    elif compressor.entropy_coding:
        raise ValueError(f"unknown entropy coding {compressor.entropy_coding!r}")
    version = BUCKETS_VERSION if bucketed else FORMAT_VERSION
    prefix = PREFIX.pack(MAGIC, version, 0, len(headers), total)
    if into is not None:  # the CRC is computed as the buffer is filled
        checked = [  # float32 payloads: part 0 is the prefix and the headers, then the data
            1 + k
            for k, (payload, _) in enumerate(compressed)
            if isinstance(payload, DensePayload) and payload.values.dtype == torch.float32
        ] if fused_check else []  # fmt: skip
        try:
            return into.write(
                [prefix + b"".join(headers), *data], total, finite_float32=checked, seal=True
            )
        except NonFiniteValues as error:
            name = names[error.part - 1]
            raise ValueError(f"tensor {name!r}: tensor has NaN or Inf values") from None
    crc = crc32_of(data, crc32_of(headers, zlib.crc32(prefix)))
    return b"".join([prefix, *headers, *data, CRC.pack(crc)])


def _compress_all(
    names: list[str],
    inputs: list[torch.Tensor],
    shared: list[float | None],
    compressor: Compressor,
    batch: Callable[..., list[tuple[Payload, Context]]] | None = None,
) -> list[tuple[Payload, Context]]:
    """``batch`` (default ``compressor.compress_batch``) on all tensors (one threaded
    pass), or, if it raises, ``compressor.compress`` one by one to name the bad tensor."""
    try:
        return (batch or compressor.compress_batch)(inputs, shared)
    except (ValueError, TypeError):
        compressed = []
        for name, tensor, scale in zip(names, inputs, shared, strict=True):
            with _naming(name):
                compressed.append(compressor.compress(tensor, scale=scale))
        return compressed


def _compress_split(
    names: list[str],
    inputs: list[torch.Tensor],
    shared: list[float | None],
    compressor: Compressor,
    exempt: set[str],
) -> list[tuple[Payload, Context]]:
    """``compressor`` on the tensors not in ``exempt``, the identity on those in it."""
    keep = [i for i, name in enumerate(names) if name not in exempt]
    out: list[tuple[Payload, Context] | None] = [None] * len(names)
    picked = _compress_all(
        [names[i] for i in keep], [inputs[i] for i in keep], [shared[i] for i in keep], compressor
    )
    for i, result in zip(keep, picked, strict=True):
        out[i] = result
    identity = IdentityCompressor()
    for i, name in enumerate(names):
        if name in exempt:
            with _naming(name):
                out[i] = identity.compress(inputs[i])
    return [r for r in out if r is not None]
