"""Unpacking of ternary codes (layout: :mod:`.packing`) into ``scale * value`` float32,
by table lookups: 256-entry tables that already hold ``scale * value``, gathered over the
threads (:mod:`.parallel`) or by the compiled kernels (:mod:`.jit`), bit-identical.
Invalid codes decode to 0: check them first (:func:`.packing.invalid_codes`). Five-level
codes (``"base5"``) are decoded by the numpy gather of :mod:`.base5` in the same passes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from fedddl.compression.backends.base5 import Base5Gather
from fedddl.compression.backends.jit import jit_kernels
from fedddl.compression.backends.packing import codes_per_byte, packed_size
from fedddl.compression.backends.parallel import run_in_chunks, run_pipelined

__all__ = [
    "is_small",
    "unpack_code_rows",
    "unpack_codes",
    "unpack_codes_batch",
    "unpack_codes_into",
    "unpack_codes_new",
]

_VALUE_OF_CODE = (0.0, 1.0, -1.0)


def _build_tables() -> dict[str, np.ndarray]:
    two_bit = np.zeros((256, 4), dtype=np.float32)
    base3 = np.zeros((256, 5), dtype=np.float32)
    for byte in range(256):
        for slot in range(4):
            code = (byte >> (2 * slot)) & 0b11
            two_bit[byte, slot] = _VALUE_OF_CODE[code] if code < 3 else 0.0
        rest = byte
        for slot in range(5):
            base3[byte, slot] = _VALUE_OF_CODE[rest % 3] if byte < 243 else 0.0
            rest //= 3
    return {"2bit": two_bit, "base3": base3}


_TABLES = _build_tables()
# the base-3 table as rows of 8 float32 (5 used), flat, for the compiled kernel
_BASE3_ROWS = np.zeros((256, 8), dtype=np.float32)
_BASE3_ROWS[:, :5] = _TABLES["base3"]
_UNPACK_CHUNK = 1 << 16  # packed bytes per gather (1 MiB of float32 out): small intp index
_TOUCH_SEGMENT = 1 << 18  # packed bytes per first-touch segment (4-5 MiB of float32 out)
_PAGE = 4096
_SMALL_NUMEL = 1 << 16  # values: fewer are unpacked on the calling thread, in one pass


def unpack_code_rows(
    rows: np.ndarray[Any, Any],
    numel: int,
    scales: np.ndarray[Any, Any],
    codec: str,
    target: np.ndarray[Any, Any],
) -> None:
    """:func:`unpack_codes_into` of each row of valid packed codes (``rows``: 2-D
    ``uint8``, one tensor's codes per row, as :func:`invalid_code_rows` checks them) at its
    own scale (``scales``: float32, one per row) into the float32 rows of ``target``
    (``rows × numel``), in one numpy pass: the same values, ``code × scale`` in float32."""
    if codec == "base5":
        for row, scale, out in zip(rows, scales, target, strict=True):
            Base5Gather(row, numel, float(scale), out).run_all()
        return
    count, per = rows.shape[0], codes_per_byte(codec)
    whole = numel // per
    table = _TABLES[codec]
    codes = np.take(table, rows[:, :whole].astype(np.intp), axis=0)  # count × whole × per
    target[:, : whole * per] = codes.reshape(count, whole * per)
    used = numel - whole * per
    if used:
        target[:, whole * per :] = table[rows[:, whole], :used]
    target *= scales.astype(np.float32).reshape(count, 1)


def unpack_codes(
    packed: torch.Tensor,
    numel: int,
    scale: float,
    codec: str = "2bit",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpack ``numel`` codes of ``codec`` into a 1-D float32 tensor of ``scale * value``.

    ``packed`` is 1-D ``uint8`` (:func:`packed_size` bytes). Invalid codes decode to 0 (use
    :func:`find_invalid_codes` to reject them). Writes into ``out`` (1-D contiguous float32
    CPU, ``numel`` elements) when given, else into a new tensor (:func:`unpack_codes_new`);
    uses up to ``torch.get_num_threads()`` threads. Returns ``out`` or the new tensor, never
    an alias of ``packed``.
    """
    if out is None:
        return unpack_codes_new([(packed, numel, scale, codec)])[0]
    unpack_codes_batch([(packed, numel, scale, codec, out)])
    return out


def is_small(numel: int) -> bool:
    """Whether unpacking ``numel`` values runs on the calling thread in one numpy pass:
    fewer than ``2**16`` values, unless the compiled kernels are forced on
    (:func:`fedddl.compression.backends.jit.set_jit`)."""
    return numel < _SMALL_NUMEL and jit_kernels(numel) is None


def unpack_codes_into(
    source: np.ndarray[Any, Any], numel: int, scale: float, codec: str, target: np.ndarray[Any, Any]
) -> None:
    """:func:`unpack_codes` of valid packed codes (a 1-D ``uint8`` numpy array of
    :func:`packed_size` bytes) into a 1-D float32 numpy array of ``numel`` values, on the
    calling thread with numpy: for small tensors, where batching over the threads costs
    more than it saves."""
    gather = _gather(source, numel, scale, codec, target)
    gather.run(0, gather.whole)
    gather.finish()


def unpack_codes_new(items: Sequence[tuple[torch.Tensor, int, float, str]]) -> list[torch.Tensor]:
    """:func:`unpack_codes` of several tensors into new tensors, in one threaded pass.

    Each item is ``(packed, numel, scale, codec)``. The calling thread first-touches
    every page of a segment while the pool decodes the segments already touched (why:
    docs/ARCHITECTURE.md).
    """
    if is_small(sum(numel for _, numel, _, _ in items)):  # one thread, no pipelining
        small = []
        for packed, numel, scale, codec in items:
            _check_packed(packed, numel, codec)
            values = np.empty(numel, dtype=np.float32)
            unpack_codes_into(packed.numpy(), numel, scale, codec, values)
            small.append(torch.from_numpy(values))
        return small
    targets = []
    gathers: list[_Gather | Base5Gather] = []
    for packed, numel, scale, codec in items:
        _check_packed(packed, numel, codec)
        target: np.ndarray[Any, Any] = np.empty(numel, dtype=np.float32)
        targets.append(torch.from_numpy(target))
        gathers.append(_gather(packed.numpy(), numel, scale, codec, target))
    batch = _Batch(gathers)
    run_pipelined(batch.touch, batch.run, batch.total, _TOUCH_SEGMENT)
    batch.finish()
    return targets


def unpack_codes_batch(
    items: Sequence[tuple[torch.Tensor, int, float, str, torch.Tensor]],
) -> None:
    """:func:`unpack_codes` of several tensors into their buffers, in one threaded pass.

    Each item is ``(packed, numel, scale, codec, out)`` with ``out`` as in
    :func:`unpack_codes`.  The work of all items is split into equal shares
    over the threads, so many small tensors decode as fast as one large one.
    """
    gathers: list[_Gather | Base5Gather] = []
    for packed, numel, scale, codec, out in items:
        _check_packed(packed, numel, codec)
        if (
            out.dtype != torch.float32
            or out.device.type != "cpu"
            or out.dim() != 1
            or out.numel() != numel
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be a contiguous 1-D float32 CPU tensor of {numel} elements, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        gathers.append(_gather(packed.numpy(), numel, scale, codec, out.detach().numpy()))
    batch = _Batch(gathers)
    run_in_chunks(batch.run, batch.total, _UNPACK_CHUNK)
    batch.finish()


def _check_packed(packed: torch.Tensor, numel: int, codec: str) -> None:
    if packed.numel() != packed_size(numel, codec):
        raise ValueError(
            f"{packed.numel()} code bytes for {numel} values (need {packed_size(numel, codec)})"
        )


def _gather(
    source: np.ndarray[Any, Any], numel: int, scale: float, codec: str,
    target: np.ndarray[Any, Any],
) -> _Gather | Base5Gather:  # fmt: skip
    """The gather that decodes one tensor's packed bytes of ``codec`` into ``target``."""
    if codec == "base5":
        return Base5Gather(source, numel, scale, target)
    return _Gather(source, numel, scale, codec, target)


class _Gather:
    """Table lookups that decode one tensor's packed bytes into ``target``."""

    def __init__(
        self,
        source: np.ndarray[Any, Any],
        numel: int,
        scale: float,
        codec: str,
        target: np.ndarray[Any, Any],
    ) -> None:
        per = codes_per_byte(codec)
        self.source = source
        self.target, self.numel, self.per = target, numel, per
        self.whole = numel // per  # bytes whose every slot holds a value
        self.codec = codec
        self.flat_rows: np.ndarray[Any, Any] | None = None
        if codec == "2bit":
            self.table: np.ndarray[Any, Any] = _TABLES[codec] * np.float32(scale)
            # one 16-byte entry (4 float32) per byte: gather it as a single complex128
            self.rows: np.ndarray[Any, Any] = self.table.view(np.complex128).reshape(256)
            self.dest = target[: self.whole * 4].view(np.complex128)
        else:  # one scaled table, rows of 8 (5 used): the kernel reads whole rows
            rows = _BASE3_ROWS * np.float32(scale)
            self.flat_rows, self.table = rows.reshape(-1), rows[:, :5]
            self.rows, self.dest = self.table, target[: self.whole * 5].reshape(self.whole, 5)

    def run(self, lo: int, hi: int, kernels: ModuleType | None = None) -> None:
        """Decode whole bytes ``lo .. hi`` (with the compiled ``kernels``, if given)."""
        if kernels is not None:
            if self.flat_rows is not None:
                target = self.target[lo * 5 : hi * 5]
                kernels.unpack_base3(self.source[lo:hi], self.flat_rows, target)
            else:
                kernels.unpack_2bit(self.source[lo:hi], self.rows, self.dest[lo:hi])
            return
        for start in range(lo, hi, _UNPACK_CHUNK):
            stop = min(start + _UNPACK_CHUNK, hi)
            index = self.source[start:stop].astype(np.intp)
            np.take(self.rows, index, axis=0, out=self.dest[start:stop])

    def finish(self) -> None:
        """Decode the partly used last byte, if any."""
        used = self.numel - self.whole * self.per
        if used:
            self.target[self.whole * self.per :] = self.table[self.source[self.whole], :used]

    def touch(self, lo: int, hi: int) -> None:
        """Write one byte of every 4 KiB page that decoding bytes ``lo .. hi`` will fill."""
        self.target[lo * self.per : hi * self.per].view(np.uint8)[::_PAGE] = 0


class _Batch:
    """Several gathers seen as one range: the concatenation of their whole bytes."""

    def __init__(self, gathers: list[_Gather | Base5Gather]) -> None:
        self.gathers = gathers
        self.starts = list(itertools.accumulate((g.whole for g in gathers), initial=0))
        self.total = self.starts[-1]
        self.kernels = jit_kernels(sum(g.numel for g in gathers))

    def _pieces(self, lo: int, hi: int) -> Iterator[tuple[_Gather | Base5Gather, int, int]]:
        index = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            end = min(hi, self.starts[index + 1])
            if end > lo:
                yield self.gathers[index], lo - self.starts[index], end - self.starts[index]
            lo = end
            index += 1

    def run(self, lo: int, hi: int) -> None:
        for gather, start, stop in self._pieces(lo, hi):
            gather.run(start, stop, self.kernels)

    def touch(self, lo: int, hi: int) -> None:
        for gather, start, stop in self._pieces(lo, hi):
            gather.touch(start, stop)

    def finish(self) -> None:
        for gather in self.gathers:
            gather.finish()
