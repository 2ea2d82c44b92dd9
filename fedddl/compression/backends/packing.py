"""Packing of ternary codes into bytes, and the lookup tables that unpack them.

Each value is a code ``0`` = 0, ``1`` = +1, ``2`` = -1 (``0b11`` is invalid).

``"2bit"`` (4 values per byte)
    Value ``i`` lives in byte ``i // 4`` at bits ``2*(i % 4)`` and ``2*(i % 4) + 1``.
``"base3"`` (5 values per byte, 1.6 bits per value)
    Byte ``j`` holds values ``5j .. 5j+4`` as ``t0 + 3*t1 + 9*t2 + 27*t3 + 81*t4``
    (bytes ``243..255`` are invalid).

Unused trailing slots of the last byte must be zero. Both directions are vectorised and
threaded (:mod:`.parallel`); the host must be little-endian (checked at import).
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from fedddl.compression.backends.jit import jit_kernels
from fedddl.compression.backends.parallel import run_in_chunks, run_pipelined

__all__ = [
    "CODECS",
    "CODE_MINUS",
    "CODE_PLUS",
    "CODE_ZERO",
    "PACK_SLACK",
    "codes_per_byte",
    "find_invalid_codes",
    "invalid_code_rows",
    "invalid_codes",
    "is_small",
    "pack_codes",
    "pack_codes_into",
    "pack_padded_codes",
    "packed_size",
    "unpack_code_rows",
    "unpack_codes",
    "unpack_codes_batch",
    "unpack_codes_into",
    "unpack_codes_new",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is LE
    raise ImportError("fedddl.compression assumes a little-endian host")

CODE_ZERO = 0b00
CODE_PLUS = 0b01
CODE_MINUS = 0b10

#: Names of the packing codecs.
CODECS: tuple[str, ...] = ("2bit", "base3")

_PER_BYTE = {"2bit": 4, "base3": 5}
_VALUE_OF_CODE = (0.0, 1.0, -1.0)
_MASK_LOW_BITS = 0x5555555555555555  # bit 0 of every 2-bit slot in an int64


def codes_per_byte(codec: str) -> int:
    """How many values one byte holds under ``codec``."""
    try:
        return _PER_BYTE[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}") from None


def packed_size(numel: int, codec: str) -> int:
    """Bytes needed to pack ``numel`` values with ``codec``."""
    per = codes_per_byte(codec)
    return -(-numel // per)


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
#: Bytes a code buffer needs past its last code for :func:`pack_padded_codes`.
PACK_SLACK = 8
_UNPACK_CHUNK = 1 << 16  # packed bytes per gather (1 MiB of float32 out): small intp index
_TOUCH_SEGMENT = 1 << 18  # packed bytes per first-touch segment (4-5 MiB of float32 out)
_PAGE = 4096
_SMALL_NUMEL = 1 << 16  # values: fewer are unpacked on the calling thread, in one pass
# (w * _GATHER_2BIT) >> 24 of a little-endian uint32 of 4 codes c0..c3 is
# c0 + c1<<2 + c2<<4 + c3<<6: each code lands in its own slot of the top byte,
# every cross term lands in distinct lower slots or overflows, so no carries.
_GATHER_2BIT = np.uint32((1 << 24) | (1 << 18) | (1 << 12) | (1 << 6))
# (w * _GATHER_BASE3) >> 56 of a little-endian uint64 whose low 5 bytes are
# trits t0..t4 is sum(t_k * 3**k) (<= 242): the cross terms below the top byte
# are each at most 2 * (3 + 9 + 27 + 81) = 240 per byte, so nothing carries
# into it, and those above it (including the 3 bytes of the next group) overflow.
_GATHER_BASE3 = np.uint64(sum(3**k << (56 - 8 * k) for k in range(5)))


def pack_padded_codes(
    buffer: np.ndarray[Any, Any], numel: int, out: np.ndarray[Any, Any], codec: str
) -> None:
    """Pack ``buffer[:numel]`` (``uint8`` codes ``0..2``) into ``out``.

    ``buffer`` must hold at least ``numel + PACK_SLACK`` bytes; everything from
    ``buffer[numel]`` on is scratch, and the 2-bit codec also overwrites the
    codes.  ``out`` must hold :func:`packed_size` bytes.
    """
    per = codes_per_byte(codec)
    nbytes = -(-numel // per)
    if buffer.size < numel + PACK_SLACK or out.size != nbytes:
        raise ValueError("pack_padded_codes: buffer or out has the wrong size")
    if nbytes == 0:
        return
    buffer[numel : nbytes * per + 3] = 0  # padding codes (and, for base-3, the overread)
    if codec == "2bit":
        words = buffer[: nbytes * 4].view(np.uint32)
        np.multiply(words, _GATHER_2BIT, out=words)
        np.copyto(out, words.view(np.uint8)[3::4])
        return
    # one unaligned uint64 per group of 5 codes: bytes 5j .. 5j+7
    groups = as_strided(buffer[:8].view(np.uint64), shape=(nbytes,), strides=(5,))
    gathered = np.multiply(groups, _GATHER_BASE3)
    np.copyto(out, gathered.view(np.uint8)[7::8])


def pack_codes_into(codes: np.ndarray[Any, Any], out: np.ndarray[Any, Any], codec: str) -> None:
    """Pack ``uint8`` codes into ``out`` (:func:`packed_size` bytes); ``codes`` is not modified."""
    buffer = np.empty(codes.size + PACK_SLACK, dtype=np.uint8)
    buffer[: codes.size] = codes
    pack_padded_codes(buffer, codes.size, out, codec)


def pack_codes(codes: torch.Tensor, codec: str = "2bit") -> torch.Tensor:
    """Pack a 1-D ``uint8`` tensor of codes in ``{0, 1, 2}`` into bytes.

    Parameters
    ----------
    codes:
        1-D ``uint8`` codes (``CODE_ZERO``, ``CODE_PLUS``, ``CODE_MINUS``).
    codec:
        ``"2bit"`` or ``"base3"``.

    Returns
    -------
    torch.Tensor
        1-D ``uint8`` tensor of :func:`packed_size` bytes.
    """
    codes_per_byte(codec)
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise ValueError(f"codes must be a 1-D uint8 tensor, got {codes.dim()}-D {codes.dtype}")
    if bool((codes > CODE_MINUS).any()):
        raise ValueError("codes must be 0, 1 or 2")
    out = np.empty(packed_size(codes.numel(), codec), dtype=np.uint8)
    pack_codes_into(codes.numpy(), out, codec)
    return torch.from_numpy(out)


def find_invalid_codes(packed: torch.Tensor, numel: int, codec: str) -> str | None:
    """Describe the first problem in ``packed`` codes, or return ``None`` if valid.

    Checks the byte count, invalid code values (``0b11`` or bytes ``>= 243``)
    and that unused trailing slots are zero.
    """
    codes_per_byte(codec)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        return f"packed codes must be 1-D uint8, got {packed.dim()}-D {packed.dtype}"
    return invalid_codes(packed.numpy(), numel, codec)


def invalid_codes(source: np.ndarray[Any, Any], numel: int, codec: str) -> str | None:
    """:func:`find_invalid_codes` of packed codes in a 1-D ``uint8`` numpy array."""
    if source.size != packed_size(numel, codec):
        return f"{source.size} code bytes for {numel} values (need {packed_size(numel, codec)})"
    if numel == 0:
        return None
    last = int(source[-1])
    if codec == "2bit":
        whole = source.size // 8 * 8
        words = source[:whole].view(np.uint64)
        # a slot is 0b11 iff its high bit and its low bit are both set
        if bool(((words & (words >> np.uint64(1))) & np.uint64(_MASK_LOW_BITS)).any()):
            return "invalid ternary code 0b11"
        tail = source[whole:]
        if bool(((tail & (tail >> 1)) & 0x55).any()):
            return "invalid ternary code 0b11"
        used = numel % 4
        if used and last >> (2 * used):
            return "non-zero padding in the last code byte"
        return None
    if bool((source >= 243).any()):
        return "invalid base-3 byte (>= 243)"
    used = numel % 5
    if used and last >= 3**used:
        return "non-zero padding in the last code byte"
    return None


def invalid_code_rows(rows: np.ndarray[Any, Any], numel: int, codec: str) -> bool:
    """Whether :func:`invalid_codes` finds a problem in any row of ``rows``: a 2-D
    ``uint8`` array holding one tensor's packed codes per row (the same tensor of several
    messages), checked in one pass."""
    if rows.ndim != 2 or rows.shape[1] != packed_size(numel, codec):
        return True
    if numel == 0 or rows.shape[0] == 0:
        return False
    last = rows[:, -1]
    if codec == "2bit":
        used = numel % 4
        return bool(((rows & (rows >> 1)) & 0x55).any()) or bool(
            used and (last >> (2 * used)).any()
        )
    used = numel % 5
    return bool((rows >= 243).any()) or bool(used and (last >= 3**used).any())


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
    """Unpack codes into a 1-D float32 tensor of ``scale * value``.

    Invalid codes decode to 0; use :func:`find_invalid_codes` to reject them.

    Parameters
    ----------
    packed:
        1-D ``uint8`` packed codes (:func:`packed_size` bytes).
    numel, scale, codec:
        What the codes describe.
    out:
        Optional 1-D contiguous float32 CPU tensor of ``numel`` elements to
        write into.  Without it a new tensor is allocated
        (:func:`unpack_codes_new`); a warm, reused buffer is about twice as
        fast for large tensors (no page faults).  Both use up to
        ``torch.get_num_threads()`` threads.

    Returns
    -------
    torch.Tensor
        ``out``, or the new tensor; it never aliases ``packed``.
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
    gather = _Gather(source, numel, scale, codec, target)
    gather.run(0, gather.whole)
    gather.finish()


def unpack_codes_new(items: Sequence[tuple[torch.Tensor, int, float, str]]) -> list[torch.Tensor]:
    """:func:`unpack_codes` of several tensors into new tensors, in one threaded pass.

    Each item is ``(packed, numel, scale, codec)``.  The first touch of new
    memory page-faults, and concurrent faults from two threads were measured
    3-5x slower than one thread's here; so the calling thread touches every
    page of a segment (one byte per 4 KiB page) while the pool decodes the
    segments it has already touched.
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
    gathers = []
    for packed, numel, scale, codec in items:
        _check_packed(packed, numel, codec)
        target: np.ndarray[Any, Any] = np.empty(numel, dtype=np.float32)
        targets.append(torch.from_numpy(target))
        gathers.append(_Gather(packed.numpy(), numel, scale, codec, target))
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
    gathers = []
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
        gathers.append(_Gather(packed.numpy(), numel, scale, codec, out.detach().numpy()))
    batch = _Batch(gathers)
    run_in_chunks(batch.run, batch.total, _UNPACK_CHUNK)
    batch.finish()


def _check_packed(packed: torch.Tensor, numel: int, codec: str) -> None:
    if packed.numel() != packed_size(numel, codec):
        raise ValueError(
            f"{packed.numel()} code bytes for {numel} values (need {packed_size(numel, codec)})"
        )


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

    def __init__(self, gathers: list[_Gather]) -> None:
        self.gathers = gathers
        self.starts = list(itertools.accumulate((g.whole for g in gathers), initial=0))
        self.total = self.starts[-1]
        self.kernels = jit_kernels(sum(g.numel for g in gathers))

    def _pieces(self, lo: int, hi: int) -> Iterator[tuple[_Gather, int, int]]:
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
