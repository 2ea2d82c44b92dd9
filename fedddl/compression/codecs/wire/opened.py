"""Opened messages: the header read and checked once, then compared and decoded
(one message, or several small ones of one layout at once)."""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedddl.compression.backends.packing import invalid_code_rows
from fedddl.compression.backends.unpacking import is_small, unpack_code_rows
from fedddl.compression.codecs.errors import PayloadError
from fedddl.compression.codecs.limits import DEFAULT_MAX_BYTES
from fedddl.compression.codecs.wire.decode import (
    check_out,
    decode_layout,
    fits_small_path,
    resolve_limits,
)
from fedddl.compression.codecs.wire.header import Layout, as_view, validated_entries
from fedddl.compression.codecs.wire.layout import (
    CODEC_OF_KIND,
    KIND_DENSE,
)

__all__ = ["EntryHeader", "OpenedMessage", "decode_small_batch", "open_message", "read_header"]

@dataclass(frozen=True)
class EntryHeader:
    """One tensor of a message, as its header describes it (see :func:`read_header`).

    Attributes
    ----------
    name : str
        Tensor name.
    dtype : torch.dtype
        The dtype the tensor decodes to.
    codec : str | None
        ``"2bit"`` or ``"base3"`` for a ternary entry, None for a dense one.
    shape : tuple[int, ...]
        Tensor shape.
    scale : float
        The ternary scale (finite, >= 0; 0.0 for a dense entry): every decoded value of a
        ternary entry is ``-scale``, 0 or ``scale``; with scale buckets the largest bucket
        scale (a value of bucket ``b`` is ``-s_b``, 0 or ``s_b``, ``s_b <= scale``).
    data_bytes : int
        Bytes of the entry's data.
    peak : float | None
        The largest magnitude of the decoded values: ``scale`` for a ternary entry; for a
        dense entry measured when :func:`read_header` was asked for ``dense_peaks``
        (otherwise None).
    bucket : int
        Values per scale bucket; 0: one scale for the tensor.
    """

    name: str
    dtype: torch.dtype
    codec: str | None
    shape: tuple[int, ...]
    scale: float
    data_bytes: int
    peak: float | None = None
    bucket: int = 0

    @property
    def numel(self) -> int:
        """Number of values."""
        return math.prod(self.shape)


def read_header(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_tensors: int | None = None,
    max_values: int | None = None,
    dense_peaks: bool = False,
) -> list[EntryHeader]:
    """Read and check a message's header without decoding (or allocating) any tensor.

    Checks everything :func:`decode_update` checks before it touches the data: magic,
    version, length, CRC, flags, every entry (names, dtypes, kinds, shapes, scales) and that
    the declared data sizes add up to the bytes present; code values are not read. An
    entropy-coded message is decompressed first (to at most
    :data:`fedddl.compression.codecs.entropy.MAX_EXPANSION` times its size, and to at most
    ``max_bytes``). ``max_bytes`` / ``max_tensors`` / ``max_values`` refuse a longer message,
    or one declaring more tensors or values, as in :func:`decode_update` (None: the
    defaults); ``dense_peaks`` also reads the dense entries' values for
    :attr:`EntryHeader.peak`. Returns the entries in message order.

    Raises
    ------
    PayloadError
        For any malformed header, a message over a limit (naming it), or (with
        ``dense_peaks``) a non-finite dense value.
    """
    return open_message(
        data,
        max_bytes=max_bytes,
        max_tensors=max_tensors,
        max_values=max_values,
        dense_peaks=dense_peaks,
    ).entries

def open_message(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_tensors: int | None = None,
    max_values: int | None = None,
    dense_peaks: bool = False,
) -> OpenedMessage:
    """Read and check a message's header (as :func:`read_header`) and keep what decoding
    needs, so that a receiver who checks the entries first decodes without reading the
    header a second time (:meth:`OpenedMessage.decode`).

    Raises
    ------
    PayloadError
        As :func:`read_header`.
    """
    view = as_view(data, max_bytes)
    tensors, values = resolve_limits(None, max_tensors, max_values)
    body, parsed, start, sizes = validated_entries(view, tensors, values, max_bytes)
    entries = []
    offset = start
    for (name, dtype, kind, shape, scale, bucket), size in zip(parsed, sizes, strict=True):
        peak: float | None = scale
        if kind == KIND_DENSE:
            peak = _dense_peak(name, body[offset : offset + size], dtype) if dense_peaks else None
        codec = None if kind == KIND_DENSE else CODEC_OF_KIND[kind]
        entries.append(EntryHeader(name, dtype, codec, shape, scale, size, peak, bucket))
        offset += size
    # an entropy-coded body is our own decompressed copy; other bytes objects are immutable
    stable = body is not view or isinstance(data, bytes)
    return OpenedMessage(entries, Layout(body, parsed, start, sizes), data, stable)


class OpenedMessage:
    """A message whose header was read and checked by :func:`open_message`.

    Attributes
    ----------
    entries : list[EntryHeader]
        The message's entries, in message order.
    """

    def __init__(
        self,
        entries: list[EntryHeader],
        layout: Layout,
        data: bytes | bytearray | memoryview,
        stable: bool,
    ) -> None:
        self.entries = entries
        self._layout, self._data, self._stable = layout, data, stable

    def decode(self, out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Decode the message, as :func:`decode_update` (``out`` likewise).

        A message given as ``bytes`` (immutable), or entropy-coded (decompressed into a
        buffer of its own), is decoded from the header read at opening; one in a mutable
        buffer is checked again first, and refused if its header changed since.

        Raises
        ------
        PayloadError
            As :func:`decode_update`; nothing is written partially decoded.
        """
        layout = self._layout
        if not self._stable:
            entries = self._layout.entries
            values = sum(math.prod(shape) for _, _, _, shape, _, _ in entries)
            view = as_view(self._data, sys.maxsize)  # its size was checked at opening
            layout = Layout(*validated_entries(view, len(entries), values, len(view)))
            if layout.entries != self._layout.entries:
                raise PayloadError("the message's header changed after it was read")
        return decode_layout(layout, out)


def decode_small_batch(
    messages: Sequence[OpenedMessage], like: Mapping[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]] | None:
    """Decode several small messages of one layout at once, or None.

    Per message, new float32 CPU tensors holding bit for bit what
    ``message.decode(out=like)`` would write into ``like`` (whose tensors only give the
    names, the shapes and that the small in-place path applies; they are not written).
    One numpy pass per tensor over all the messages replaces the per-message steps of
    :meth:`OpenedMessage.decode`, which dominate for small models. The caller bounds
    the memory: ``len(messages)`` rows of every tensor.

    Returns None, having decoded nothing, when the batch does not apply: fewer than two
    messages, a message in a mutable buffer, layouts that differ (names, dtypes, codecs,
    shapes, in order), a layout that ``like`` does not fit or that is not small
    (:func:`~fedddl.compression.backends.unpacking.is_small`), or an invalid code or non-zero
    padding in any message. Decode those one at a time with :meth:`OpenedMessage.decode`,
    which says what is wrong with which message.
    """
    if len(messages) < 2 or not all(m._stable for m in messages):
        return None
    first = messages[0]._layout
    if not is_small(sum(math.prod(shape) for _, _, _, shape, _, _ in first.entries)):
        return None  # before comparing layouts: a large model's replies never batch
    shape_of = [entry[:4] for entry in first.entries]
    for message in messages[1:]:
        layout = message._layout
        if (
            layout.start != first.start
            or layout.sizes != first.sizes
            or [entry[:4] for entry in layout.entries] != shape_of
        ):
            return None
    try:
        check_out(like, first.entries)
    except PayloadError:
        return None
    if not fits_small_path(first.entries, like):
        return None
    count = len(messages)
    columns: list[tuple[str, np.ndarray[Any, Any]]] = []
    offset = first.start
    for index, ((name, _, kind, shape, _, _), size) in enumerate(
        zip(first.entries, first.sizes, strict=True)
    ):
        rows = np.empty((count, size), dtype=np.uint8)
        for row, message in zip(rows, messages, strict=True):
            row[:] = np.frombuffer(message._layout.body, dtype=np.uint8, count=size, offset=offset)
        offset += size
        numel = math.prod(shape)
        values = np.empty((count, numel), dtype=np.float32)
        if kind == KIND_DENSE:  # float32 (the small path's condition): its bytes
            values.view(np.uint8)[:] = rows
        else:
            codec = CODEC_OF_KIND[kind]
            if invalid_code_rows(rows, numel, codec):
                return None
            scales = np.array([m._layout.entries[index][4] for m in messages], np.float32)
            unpack_code_rows(rows, numel, scales, codec, values)
        columns.append((name, values.reshape(count, *shape)))
    return [
        {name: torch.from_numpy(values[row, ...]) for name, values in columns}
        for row in range(count)
    ]


def _dense_peak(name: str, raw: memoryview, dtype: torch.dtype) -> float:
    """The largest magnitude of a dense entry's values (raw bytes of ``dtype``)."""
    if not len(raw):
        return 0.0
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is not None:  # read in place, two reductions, no copy
        values = np.frombuffer(raw, dtype=numpy_dtype)
        peak = max(float(values.max()), -float(values.min()))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: copied out of
            tensor = torch.frombuffer(raw, dtype=torch.uint8).clone().view(dtype)
        peak = float(tensor.abs().max())
    if not math.isfinite(peak):
        raise PayloadError(f"tensor {name!r}: non-finite value")
    return peak


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
