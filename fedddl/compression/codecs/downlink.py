"""The broadcast (downlink) update formats, shared by the server and every client; the
first byte tells them apart (all integers little-endian):

``b"E"`` + :func:`fedddl.compression.encode_update` bytes
    The aggregate re-encoded with a compressor (``reternarize``, or the fp32 identity).
``b"S"`` shared-scale sum (``shared-scale-sum``)
    When all N clients ternarised tensor ``k`` with the same scale ``s_k``, the sum of
    their codes (in ``[-N, N]``) is sent as ``sum + N`` in ``ceil(log2(2N + 1))`` bits
    and decodes to ``s_k * sum / N``, the exact mean of their decoded gradients::

        b"S", u16 N, u32 count,
        count x (u16 name length, name, u8 ndim, ndim x u32 dims, f32 scale, u8 bits),
        packed data of every entry (ceil(numel * bits / 8) bytes each), u32 crc32
``b"B"`` bundle (only when there is more than a gradient to send)
    ``b"B", u8 count, count x (u8 kind, u64 length, bytes), u32 crc32`` with kinds 1
    (the gradient as ``E``/``S``), 2 (fp32 gradients of exempt tensors), 3 (pooled
    BatchNorm statistics), each at most once, in that order; 2 and 3 are identity
    :func:`encode_update` bytes.

:func:`decode_broadcast_parts` and :func:`decode_broadcast` raise
:class:`~fedddl.compression.PayloadError` on anything malformed, and on a section declaring
more tensors or values than their limits (``max_tensors`` / ``max_values``, as
:func:`~fedddl.compression.decode_update`'s) before anything is allocated for it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch

from fedddl.compression.algorithms.base import Compressor
from fedddl.compression.algorithms.memory import Memory
from fedddl.compression.codecs.errors import PayloadError
from fedddl.compression.codecs.limits import check_limit
from fedddl.compression.codecs.wire import decode_update, encode_update
from fedddl.compression.codecs.wire.decode import resolve_limits
from fedddl.framing import CRC, seal, unseal

__all__ = [
    "TAG_BUNDLE",
    "TAG_ENCODED",
    "TAG_SHARED_SUM",
    "add_statistics",
    "decode_broadcast",
    "decode_broadcast_parts",
    "encode_bundle",
    "encode_reencoded",
    "encode_shared_sum",
    "shared_sum_bits",
    "ternary_codes",
]

TAG_ENCODED = b"E"
TAG_SHARED_SUM = b"S"
TAG_BUNDLE = b"B"
SECTION_GRADIENT, SECTION_DENSE, SECTION_STATISTICS = 1, 2, 3
_SECTION = struct.Struct("<BQ")
_BUNDLE_WHAT = "bundled update"
_HEAD = struct.Struct("<cHI")
_WHAT = "shared-sum update"


def encode_reencoded(
    aggregate: Mapping[str, torch.Tensor],
    compressor: Compressor,
    memory: Memory | None,
    dense: Collection[str] = (),
) -> bytes:
    """Encode ``aggregate`` with ``compressor`` (and error-feedback ``memory``).

    Tensors named in ``dense`` travel in fp32 (see :func:`encode_update`).
    """
    return TAG_ENCODED + encode_update(aggregate, compressor, memory, dense=dense)


def shared_sum_bits(num_contributions: int) -> int:
    """Bits per value of a sum of ``num_contributions`` ternary codes: ``ceil(log2(2N+1))``."""
    if num_contributions < 1:
        raise ValueError(f"num_contributions must be >= 1, got {num_contributions}")
    return max(1, math.ceil(math.log2(2 * num_contributions + 1)))


def ternary_codes(decoded: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Return int8 codes ``c`` with ``decoded == scale * c``; None if not ternary at ``scale``."""
    if scale <= 0 or not math.isfinite(scale):
        return None
    flat = decoded.reshape(-1).to(torch.float32)
    s = torch.tensor(scale, dtype=torch.float32)
    plus, minus, zero = flat == s, flat == -s, flat == 0
    if not bool((plus | minus | zero).all()):
        return None
    return plus.to(torch.int8) - minus.to(torch.int8)


def encode_shared_sum(
    sums: Mapping[str, torch.Tensor],
    scales: Mapping[str, float],
    shapes: Mapping[str, Sequence[int]],
    num_contributions: int,
) -> bytes:
    """Pack integer code sums (flat, in ``[-N, N]``) with their shared scales.

    Raises
    ------
    ValueError
        If a sum is out of range or names do not match.
    """
    n = num_contributions
    bits = shared_sum_bits(n)
    if set(sums) != set(scales) or set(sums) != set(shapes):
        raise ValueError("sums, scales and shapes must have the same names")
    headers: list[bytes] = []
    blobs: list[bytes] = []
    for name, total in sums.items():
        values = total.reshape(-1).to(torch.int64)
        if values.numel() and (int(values.min()) < -n or int(values.max()) > n):
            raise ValueError(f"tensor {name!r}: code sum outside [-{n}, {n}]")
        shape = [int(d) for d in shapes[name]]
        if math.prod(shape) != values.numel():
            raise ValueError(f"tensor {name!r}: shape {shape} does not match {values.numel()} sums")
        raw = name.encode("utf-8")
        headers.append(
            struct.pack(
                f"<H{len(raw)}sB{len(shape)}IfB",
                len(raw),
                raw,
                len(shape),
                *shape,
                float(scales[name]),
                bits,
            )
        )
        shifted = (values + n).numpy().astype(np.uint32)
        bit_matrix = ((shifted[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
        blobs.append(np.packbits(bit_matrix.reshape(-1), bitorder="little").tobytes())
    return seal(_HEAD.pack(TAG_SHARED_SUM, n, len(headers)) + b"".join(headers) + b"".join(blobs))


def _decode_shared_sum(data: bytes, limits: tuple[int, int]) -> dict[str, torch.Tensor]:
    if len(data) < _HEAD.size + CRC.size:
        raise PayloadError(f"{_WHAT} is truncated: {len(data)} bytes")
    body = bytes(unseal(_WHAT, data, error=PayloadError))
    _, n, count = _HEAD.unpack_from(body)
    if n < 1:
        raise PayloadError("shared-sum update: N must be >= 1")
    check_limit(count, limits[0], "tensors", "max_tensors")
    pos = _HEAD.size
    entries: list[tuple[str, list[int], float, int]] = []
    values = 0
    try:
        for _ in range(count):
            (length,) = struct.unpack_from("<H", body, pos)
            pos += 2
            name = body[pos : pos + length].decode("utf-8")
            pos += length
            (ndim,) = struct.unpack_from("<B", body, pos)
            pos += 1
            shape = list(struct.unpack_from(f"<{ndim}I", body, pos))
            pos += 4 * ndim
            values += math.prod(shape)
            check_limit(values, limits[1], f"values (by tensor {name!r})", "max_values")
            scale, bits = struct.unpack_from("<fB", body, pos)
            pos += 5
            entries.append((name, shape, scale, bits))
    except (struct.error, UnicodeDecodeError) as err:
        raise PayloadError(f"shared-sum update: malformed header ({err})") from None
    out: dict[str, torch.Tensor] = {}
    for name, shape, scale, bits in entries:
        if bits != shared_sum_bits(n) or not math.isfinite(scale) or scale < 0:
            raise PayloadError(f"shared-sum update: tensor {name!r} has bad bits/scale")
        numel = math.prod(shape)
        size = (numel * bits + 7) // 8
        if pos + size > len(body):
            raise PayloadError(f"shared-sum update: tensor {name!r} data is truncated")
        packed = np.frombuffer(body, dtype=np.uint8, count=size, offset=pos)
        pos += size
        flat_bits = np.unpackbits(packed, bitorder="little")[: numel * bits].reshape(numel, bits)
        values = (flat_bits.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(axis=1) - n
        if numel and (values.min() < -n or values.max() > n):
            raise PayloadError(f"shared-sum update: tensor {name!r} has sums outside [-N, N]")
        sums = torch.from_numpy(values).to(torch.float32)
        out[name] = (sums * torch.tensor(scale, dtype=torch.float32) / n).reshape(shape)
    if pos != len(body):
        raise PayloadError(f"shared-sum update: {len(body) - pos} trailing bytes")
    return out


def encode_bundle(
    gradient: bytes | None,
    dense: Mapping[str, torch.Tensor] | None = None,
    statistics: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """Bundle a gradient broadcast with fp32 gradients and statistics (a ``b"B"`` update).

    Returns ``gradient`` itself when there is nothing else to send.
    """
    from fedddl.compression.algorithms.identity import IdentityCompressor

    sections: list[tuple[int, bytes]] = []
    if gradient is not None:
        sections.append((SECTION_GRADIENT, gradient))
    for kind, tensors in ((SECTION_DENSE, dense), (SECTION_STATISTICS, statistics)):
        if tensors:
            sections.append((kind, encode_update(tensors, IdentityCompressor())))
    if gradient is not None and len(sections) == 1:
        return gradient
    return _seal_bundle(sections)


def _seal_bundle(sections: Sequence[tuple[int, bytes]]) -> bytes:
    body = [TAG_BUNDLE, struct.pack("<B", len(sections))]
    for kind, data in sections:
        body += [_SECTION.pack(kind, len(data)), data]
    return seal(b"".join(body))


def add_statistics(update: bytes, statistics: Mapping[str, torch.Tensor] | None) -> bytes:
    """``update`` (any broadcast format) with ``statistics`` added as its statistics section.

    A bundle gets the section added to its own (never a bundle inside a bundle, which no
    decoder accepts); any other format becomes the gradient section of a new bundle.

    Raises
    ------
    ValueError
        If ``update`` already carries statistics.
    PayloadError
        If ``update`` is a malformed bundle.
    """
    if not statistics:
        return update
    if update[:1] != TAG_BUNDLE:
        return encode_bundle(update, statistics=statistics)
    from fedddl.compression.algorithms.identity import IdentityCompressor

    parts = _bundle_sections(update)
    if SECTION_STATISTICS in parts:
        raise ValueError("the update already carries statistics")
    parts[SECTION_STATISTICS] = encode_update(statistics, IdentityCompressor())
    return _seal_bundle(sorted(parts.items()))


def _bundle_sections(data: bytes) -> dict[int, bytes]:
    """The checked sections of a ``b"B"`` bundle by kind (their contents not decoded)."""
    body = unseal(_BUNDLE_WHAT, data, error=PayloadError)
    if len(body) < 2:
        raise PayloadError(f"{_BUNDLE_WHAT} is truncated")
    count, pos = body[1], 2
    parts: dict[int, bytes] = {}
    for _ in range(count):
        if pos + _SECTION.size > len(body):
            raise PayloadError(f"{_BUNDLE_WHAT}: truncated section header")
        kind, length = _SECTION.unpack_from(body, pos)
        pos += _SECTION.size
        if kind not in (SECTION_GRADIENT, SECTION_DENSE, SECTION_STATISTICS) or kind in parts:
            raise PayloadError(f"{_BUNDLE_WHAT}: unknown or repeated section kind {kind}")
        if parts and kind < max(parts):
            raise PayloadError(f"{_BUNDLE_WHAT}: sections out of order")
        if pos + length > len(body):
            raise PayloadError(f"{_BUNDLE_WHAT}: section {kind} is truncated")
        parts[kind] = bytes(body[pos : pos + length])
        pos += length
    if pos != len(body):
        raise PayloadError(f"{_BUNDLE_WHAT}: {len(body) - pos} trailing bytes")
    return parts


def _decode_bundle(
    data: bytes,
    out: Mapping[str, torch.Tensor] | None,
    limits: tuple[int, int],
    section_limits: tuple[int, int],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The gradient (bounded by ``limits``) and statistics of a bundle; the fp32 and the
    statistics sections are bounded by ``section_limits``."""
    parts = _bundle_sections(data)
    update: dict[str, torch.Tensor] = {}
    if SECTION_GRADIENT in parts:
        inner = parts[SECTION_GRADIENT]
        if inner[:1] not in (TAG_ENCODED, TAG_SHARED_SUM):
            raise PayloadError(f"{_BUNDLE_WHAT}: the gradient section must be E or S")
        update = _decode_gradient(inner, out, limits)
    tensors, values = section_limits
    if SECTION_DENSE in parts:
        dense = decode_update(parts[SECTION_DENSE], max_tensors=tensors, max_values=values)
        overlap = sorted(set(dense) & set(update))
        if overlap:
            raise PayloadError(f"{_BUNDLE_WHAT}: tensors sent twice: {overlap[:5]}")
        update.update(dense)
    statistics = (
        decode_update(parts[SECTION_STATISTICS], max_tensors=tensors, max_values=values)
        if SECTION_STATISTICS in parts
        else {}
    )
    return update, statistics


def _decode_gradient(
    data: bytes, out: Mapping[str, torch.Tensor] | None, limits: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """A ``b"E"`` broadcast decoded into ``out`` when given, else any broadcast."""
    if out is not None and data[:1] == TAG_ENCODED:
        decode_update(data[1:], out=out)
        return dict(out)
    return _decode_any(data, limits)


def decode_broadcast_parts(
    data: bytes,
    out: Mapping[str, torch.Tensor] | None = None,
    *,
    max_tensors: int | None = None,
    max_values: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Decode a broadcast of any format into ``(gradient by name, statistics by name)``.

    With ``out`` (one buffer per tensor of the gradient, on any device), a re-encoded
    (``b"E"``) gradient is decoded into those buffers, on their device, and they are
    returned; the other formats decode on the host. ``max_tensors`` / ``max_values`` bound
    each section (None: as in :func:`~fedddl.compression.decode_update`, ``out`` counting
    for the gradient only).

    Raises
    ------
    PayloadError
        On an unknown tag, malformed content or a section over a limit (``out`` is then
        left untouched).
    """
    limits = resolve_limits(out, max_tensors, max_values)
    if data[:1] == TAG_BUNDLE:
        sections = resolve_limits(None, max_tensors, max_values)
        return _decode_bundle(data, out, limits, sections)
    return _decode_gradient(data, out, limits), {}


def decode_broadcast(
    data: bytes, *, max_tensors: int | None = None, max_values: int | None = None
) -> dict[str, torch.Tensor]:
    """Decode the gradient of a broadcast update of any format (statistics are dropped).

    ``max_tensors`` / ``max_values``: as :func:`decode_broadcast_parts` without ``out``.

    Raises
    ------
    PayloadError
        On an unknown tag, malformed content or a section over a limit.
    """
    return _decode_any(data, resolve_limits(None, max_tensors, max_values))


def _decode_any(data: bytes, limits: tuple[int, int]) -> dict[str, torch.Tensor]:
    if not data:
        raise PayloadError("broadcast update is empty")
    tag = data[:1]
    tensors, values = limits
    if tag == TAG_ENCODED:
        return decode_update(data[1:], max_tensors=tensors, max_values=values)
    if tag == TAG_SHARED_SUM:
        return _decode_shared_sum(data, limits)
    if tag == TAG_BUNDLE:
        return _decode_bundle(data, None, limits, limits)[0]
    raise PayloadError(f"broadcast update has unknown tag {tag!r}")
