"""``decode_update``: tensors from a message, new or written into given buffers."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedddl.compression.algorithms.payload import (
    check_float_tensor,
)
from fedddl.compression.backends.device_path import unpack_into, unpacks_on_device
from fedddl.compression.backends.packing import invalid_codes
from fedddl.compression.backends.parallel import copy_bytes, copy_pieces
from fedddl.compression.backends.unpacking import (
    is_small,
    unpack_codes,
    unpack_codes_batch,
    unpack_codes_into,
    unpack_codes_new,
)
from fedddl.compression.codecs.errors import PayloadError
from fedddl.compression.codecs.limits import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_TENSORS,
    DEFAULT_MAX_VALUES,
    limits_for,
)
from fedddl.compression.codecs.wire.bucket_entries import check_bucket_data, decode_bucket_data
from fedddl.compression.codecs.wire.header import Layout, as_view, validated_entries
from fedddl.compression.codecs.wire.layout import (
    CODEC_OF_KIND,
    KIND_BASE5,
    KIND_DENSE,
    Entry,
)

__all__ = ["check_out", "decode_layout", "decode_update", "fits_small_path", "resolve_limits"]

def check_out(
    out: Mapping[str, torch.Tensor],
    entries: list[Entry],
) -> None:
    """Check that ``out`` has exactly the message's names, with matching shapes."""
    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a mapping of names to tensors, got {type(out).__name__}")
    names = [name for name, *_ in entries]
    missing = sorted(set(names) - set(out))
    unexpected = sorted(set(out) - set(names))
    if missing or unexpected:
        raise PayloadError(
            f"the message's tensors do not match out: not in out {missing}, "
            f"not in the message {unexpected}"
        )
    for name, _, _, shape, _, _ in entries:
        target = check_float_tensor(out[name])
        if tuple(target.shape) != shape:
            raise PayloadError(
                f"tensor {name!r}: the message's shape {shape} does not match "
                f"out's {tuple(target.shape)}"
            )


#: Dense entries up to this size are decoded into new tensors by one clone of their bytes
#: (larger ones are copied over the threads into new tensors, in pieces).
_SMALL_DENSE_BYTES = 1 << 16


def _is_direct_target(target: torch.Tensor, dtype: torch.dtype) -> bool:
    return target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()


def _decode_entry(
    raw: torch.Tensor,
    entry: Entry,
    target: torch.Tensor,
) -> torch.Tensor:
    """Decode one validated entry into ``target``, a tensor that is not written directly
    (another dtype or device, not contiguous): decoded, then copied in with a cast."""
    _, dtype, kind, shape, scale, bucket = entry
    if kind == KIND_DENSE:
        values = torch.empty(shape, dtype=dtype)
        copy_bytes(values.reshape(-1).view(torch.uint8).numpy(), raw.numpy())
    elif bucket:
        values = decode_bucket_data(raw.numpy(), math.prod(shape), bucket, CODEC_OF_KIND[kind])
        values = values.to(dtype).reshape(shape)
    else:
        values = unpack_codes(raw, math.prod(shape), scale, CODEC_OF_KIND[kind])
        values = values.to(dtype).reshape(shape)
    with torch.no_grad():
        target.copy_(values)
    return target


def decode_update(
    data: bytes | bytearray | memoryview,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_tensors: int | None = None,
    max_values: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a message of :func:`encode_update` into tensors by name, in message order.

    Without ``out``: new tensors with the original shapes and dtypes that own their memory.
    With ``out`` (exactly the message's names and shapes; any supported floating dtype and
    device, values cast): decoded in place and returned; ternary entries for tensors off the
    CPU cross as packed bytes and are unpacked there.

    Limits, checked before anything is allocated or decompressed: a message longer than
    ``max_bytes`` (an entropy-coded body larger than it), or declaring more than
    ``max_tensors`` tensors or ``max_values`` values in all, is refused. ``None`` means
    :data:`~fedddl.compression.codecs.limits.DEFAULT_MAX_TENSORS` (4,096) and
    :data:`~fedddl.compression.codecs.limits.DEFAULT_MAX_VALUES` (2**26), or ``out``'s own
    count and values where larger; pass larger ones for a larger model
    (``**limits_for(model)``).

    Raises
    ------
    PayloadError
        For any malformed input, a message over a limit (naming it) or one that does not
        match ``out`` (naming the problem); nothing is returned, and nothing in ``out``
        written.
    """
    tensors, values = resolve_limits(out, max_tensors, max_values)
    layout = Layout(*validated_entries(as_view(data, max_bytes), tensors, values, max_bytes))
    return decode_layout(layout, out)


def resolve_limits(
    like: Mapping[str, torch.Tensor] | None, max_tensors: int | None, max_values: int | None
) -> tuple[int, int]:
    """``(max_tensors, max_values)`` with each None replaced by the default, or by ``like``'s
    count and values where ``like`` is given and larger."""
    if like is not None:
        if not isinstance(like, Mapping):
            raise TypeError(f"out must be a mapping of names to tensors, got {type(like).__name__}")
        own = limits_for(like)
        return (
            max(own["max_tensors"], DEFAULT_MAX_TENSORS) if max_tensors is None else max_tensors,
            max(own["max_values"], DEFAULT_MAX_VALUES) if max_values is None else max_values,
        )
    return (
        DEFAULT_MAX_TENSORS if max_tensors is None else max_tensors,
        DEFAULT_MAX_VALUES if max_values is None else max_values,
    )


def decode_layout(
    layout: Layout, out: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Decode the data of a checked message (see :func:`decode_update`)."""
    entries = layout.entries
    if out is not None:
        check_out(out, entries)
        if fits_small_path(entries, out):
            return _decode_small(layout, out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we copy out of it
        raws = [torch.from_numpy(source) for source in _checked_data(layout)]
    # everything is validated: from here on nothing can fail on the message's account
    # Ternary entries decoded straight into float32 (new tensors, or float32 CPU buffers)
    # are batched: one threaded pass over all of them, however small each one is.
    result: dict[str, torch.Tensor] = {}
    into_buffers = []
    on_device: list[tuple[torch.Tensor, int, float, str, torch.Tensor]] = []
    new_items, new_entries = [], []
    dense_targets: list[np.ndarray[Any, Any]] = []  # fp32 etc. copied as bytes, in one pass
    dense_sources: list[np.ndarray[Any, Any]] = []
    for entry, raw in zip(entries, raws, strict=True):
        name, dtype, kind, shape, scale, bucket = entry
        target = None if out is None else out[name]
        if bucket:  # scale buckets: decoded on their own (then copied into a target)
            if target is None:
                numel, codec = math.prod(shape), CODEC_OF_KIND[kind]
                values = decode_bucket_data(raw.numpy(), numel, bucket, codec)
                result[name] = values.to(dtype).reshape(shape)
            else:
                result[name] = _decode_entry(raw, entry, target)
            continue
        if kind == KIND_DENSE:
            if target is None and raw.numel() <= _SMALL_DENSE_BYTES:  # fewer steps than below
                result[name] = raw.clone().view(dtype).reshape(shape)
            elif target is None or _is_direct_target(target, dtype):
                values = torch.empty(shape, dtype=dtype) if target is None else target
                dense_targets.append(values.detach().reshape(-1).view(torch.uint8).numpy())
                dense_sources.append(raw.numpy())
                result[name] = values
            else:
                result[name] = _decode_entry(raw, entry, target)
            continue
        item = (raw, math.prod(shape), scale, CODEC_OF_KIND[kind])
        if target is None:
            new_items.append(item)
            new_entries.append(entry)
            result[name] = raw  # placeholder, keeps the message order
        # off the CPU: packed bytes go there, unpacked there (base5 codes have no device
        # kernel: decoded on the CPU and copied in, by the last branch)
        elif unpacks_on_device(target) and kind != KIND_BASE5:
            on_device.append((*item, target))
            result[name] = target
        elif _is_direct_target(target, torch.float32):
            into_buffers.append((*item, target.detach().reshape(-1)))
            result[name] = target
        else:
            result[name] = _decode_entry(raw, entry, target)
    copy_pieces(dense_targets, dense_sources)
    unpack_codes_batch(into_buffers)
    unpack_into(on_device)
    for (name, dtype, _, shape, _, _), flat in zip(
        new_entries, unpack_codes_new(new_items), strict=True
    ):
        result[name] = flat.to(dtype).reshape(shape)
    return result


def fits_small_path(
    entries: list[Entry],
    out: Mapping[str, torch.Tensor],
) -> bool:
    """Whether every entry goes straight into a float32 CPU buffer, and the message is small
    (:func:`~fedddl.compression.backends.unpacking.is_small`): ternary entries of any dtype (their
    values are computed in float32) and float32 dense ones; no entry with scale buckets."""
    numel = 0
    for name, dtype, kind, shape, _, bucket in entries:
        if bucket:
            return False
        target = out[name]
        if unpacks_on_device(target) or not _is_direct_target(target, torch.float32):
            return False
        if kind == KIND_DENSE and dtype != torch.float32:
            return False
        numel += math.prod(shape)
    return is_small(numel)


def _checked_data(layout: Layout) -> list[np.ndarray[Any, Any]]:
    """Each entry's data bytes (read-only views of the body), every ternary code checked.

    Raises
    ------
    PayloadError
        Naming the first tensor with an invalid code or non-zero padding.
    """
    sources = []
    offset = layout.start
    for (name, _, kind, shape, scale, bucket), size in zip(
        layout.entries, layout.sizes, strict=True
    ):
        source = np.frombuffer(layout.body, dtype=np.uint8, count=size, offset=offset)
        offset += size
        if bucket:
            check_bucket_data(name, source, math.prod(shape), scale, bucket, CODEC_OF_KIND[kind])
        elif kind != KIND_DENSE:
            problem = invalid_codes(source, math.prod(shape), CODEC_OF_KIND[kind])
            if problem is not None:
                raise PayloadError(f"tensor {name!r}: {problem}")
        sources.append(source)
    return sources


def _decode_small(layout: Layout, out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`decode_layout` of a small message into float32 CPU buffers: every code checked
    first, then each entry written in place with numpy (the same values as the batched
    path: a ternary value is ``scale × code`` in float32, a dense one its bytes)."""
    sources = _checked_data(layout)
    # everything is validated: from here on nothing can fail on the message's account
    result = {}
    for (name, _, kind, shape, scale, _), source in zip(layout.entries, sources, strict=True):
        target = out[name]
        flat = target.detach().reshape(-1).numpy()
        if kind == KIND_DENSE:
            flat.view(np.uint8)[:] = source
        else:
            unpack_codes_into(source, math.prod(shape), scale, CODEC_OF_KIND[kind], flat)
        result[name] = target
    return result
