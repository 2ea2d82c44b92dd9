"""Five-level codes packed three to seven bits (codec ``"base5"``, 7/3 bits per value).

A value's code is ``0`` = 0, ``1`` = +1, ``2`` = -1, ``3`` = +2, ``4`` = -2 (the ternary
codes of :mod:`.packing`, extended). Values ``3k, 3k+1, 3k+2`` form group ``k``, the
number ``u = c0 + 5*c1 + 25*c2`` (``0..124``; ``125..127`` are invalid), stored in bits
``7k .. 7k+6`` of the little-endian bit stream (bit ``i`` is bit ``i % 8`` of byte
``i // 8``). The last group's unused slots and the last byte's unused bits must be zero.
Eight groups (24 values) fill seven bytes exactly: packing and unpacking work on such
blocks, read as one little-endian word each.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_VALUES",
    "MAX_BASE5_SCALE",
    "Base5Gather",
    "invalid_base5",
    "invalid_base5_rows",
    "pack_base5",
    "packed_size_base5",
    "unpack_base5",
]

BLOCK_BYTES = 7
BLOCK_VALUES = 24
#: The largest scale whose level 2 still decodes to a finite float32 (a message or payload
#: with a larger one is refused: a valid message decodes to finite values).
MAX_BASE5_SCALE = float(np.finfo(np.float32).max) / 2
_GROUPS = 8  # groups of 3 values per block
#: Blocks read at once when decoding or checking (about 1 MB of group numbers), so a large
#: tensor needs little scratch memory.
_CHUNK_BLOCKS = 1 << 14
_PAGE = 4096
_SHIFTS = np.arange(_GROUPS, dtype=np.uint64) * np.uint64(7)
#: The value of each code, and of each group number (rows of 3; invalid numbers decode to 0).
_VALUE_OF_CODE = np.array([0.0, 1.0, -1.0, 2.0, -2.0], dtype=np.float32)
_CODE_OF_LEVEL = np.array([4, 2, 0, 1, 3], dtype=np.uint8)  # index: level + 2
_GROUP_TABLE = np.zeros((128, 3), dtype=np.float32)
for _u in range(125):
    _GROUP_TABLE[_u] = _VALUE_OF_CODE[[_u % 5, _u // 5 % 5, _u // 25]]


def packed_size_base5(numel: int) -> int:
    """Bytes that hold ``numel`` values: ``ceil(7 * ceil(numel / 3) / 8)``."""
    return -(-7 * -(-numel // 3) // 8)


def pack_base5(levels: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Pack integer ``levels`` in ``[-2, 2]`` (1-D) into :func:`packed_size_base5` bytes.

    Raises
    ------
    ValueError
        If a level is outside ``[-2, 2]``.
    """
    numel = levels.size
    if numel and (int(levels.min()) < -2 or int(levels.max()) > 2):
        raise ValueError(f"levels must be in [-2, 2], got {int(levels.min())}..{int(levels.max())}")
    blocks = -(-numel // BLOCK_VALUES)
    codes = np.zeros(blocks * BLOCK_VALUES, dtype=np.uint8)
    codes[:numel] = _CODE_OF_LEVEL[levels.astype(np.intp) + 2]
    trios = codes.reshape(-1, 3)
    groups = (trios[:, 0] + 5 * trios[:, 1] + 25 * trios[:, 2]).reshape(blocks, _GROUPS)
    words = np.zeros(blocks, dtype=np.uint64)
    for slot in range(_GROUPS):
        words |= groups[:, slot].astype(np.uint64) << _SHIFTS[slot]
    data = words.view(np.uint8).reshape(blocks, 8)[:, :BLOCK_BYTES].reshape(-1)
    return np.ascontiguousarray(data[: packed_size_base5(numel)])


def _groups(source: np.ndarray[Any, Any], blocks: int) -> np.ndarray[Any, Any]:
    """The group numbers (``blocks × 8``) of the first ``blocks`` blocks of ``source``,
    read as if zero bytes followed it."""
    staged = np.zeros((blocks, 8), dtype=np.uint8)
    count = min(source.size, blocks * BLOCK_BYTES)
    if count == blocks * BLOCK_BYTES:
        staged[:, :BLOCK_BYTES] = source[:count].reshape(blocks, BLOCK_BYTES)
    else:
        flat = np.zeros(blocks * BLOCK_BYTES, dtype=np.uint8)
        flat[:count] = source[:count]
        staged[:, :BLOCK_BYTES] = flat.reshape(blocks, BLOCK_BYTES)
    words = staged.view(np.uint64)  # blocks × 1, little-endian
    return ((words >> _SHIFTS) & np.uint64(127)).astype(np.intp)


def _chunks(
    source: np.ndarray[Any, Any], lo: int, hi: int
) -> Iterator[tuple[int, np.ndarray[Any, Any]]]:
    """``(first block, its group numbers)`` of blocks ``lo .. hi`` of ``source``, in chunks
    of :data:`_CHUNK_BLOCKS` blocks (the one walk that decoding and checking share)."""
    for start in range(lo, hi, _CHUNK_BLOCKS):
        stop = min(start + _CHUNK_BLOCKS, hi)
        yield start, _groups(source[start * BLOCK_BYTES : stop * BLOCK_BYTES], stop - start)


def unpack_base5(
    source: np.ndarray[Any, Any], numel: int, scale: float, target: np.ndarray[Any, Any]
) -> None:
    """Write ``scale * value`` (float32) of the ``numel`` values packed in ``source`` (1-D
    ``uint8``, valid: :func:`invalid_base5`) into the 1-D float32 ``target``."""
    Base5Gather(source, numel, scale, target).run_all()


class Base5Gather:
    """Unpacking of one tensor's ``base5`` bytes in whole blocks, with the interface of
    the ternary gathers of :mod:`.unpacking` (``whole`` units, ``run``, ``finish``,
    ``touch``), so a batch decodes ternary and five-level tensors in one threaded pass."""

    def __init__(
        self, source: np.ndarray[Any, Any], numel: int, scale: float,
        target: np.ndarray[Any, Any],
    ) -> None:  # fmt: skip
        self.source, self.numel, self.target = source, numel, target
        self.per = BLOCK_VALUES
        self.whole = numel // BLOCK_VALUES  # blocks whose every slot holds a value
        self.table = _GROUP_TABLE * np.float32(scale)

    def run(self, lo: int, hi: int, kernels: ModuleType | None = None) -> None:
        """Decode whole blocks ``lo .. hi`` (numpy; compiled kernels are not used)."""
        del kernels
        for start, groups in _chunks(self.source, lo, hi):
            values = self.table[groups].reshape(-1)
            self.target[start * BLOCK_VALUES : start * BLOCK_VALUES + values.size] = values

    def finish(self) -> None:
        """Decode the values after the last whole block, if any."""
        used = self.numel - self.whole * BLOCK_VALUES
        if used:
            tail = self.source[self.whole * BLOCK_BYTES :]
            values = self.table[_groups(tail, 1)].reshape(-1)
            self.target[self.whole * BLOCK_VALUES :] = values[:used]

    def touch(self, lo: int, hi: int) -> None:
        """Write one byte of every 4 KiB page that decoding blocks ``lo .. hi`` will fill."""
        self.target[lo * BLOCK_VALUES : hi * BLOCK_VALUES].view(np.uint8)[::_PAGE] = 0

    def run_all(self) -> None:
        """Decode every value on the calling thread."""
        self.run(0, self.whole)
        self.finish()


def invalid_base5(source: np.ndarray[Any, Any], numel: int) -> str | None:
    """Describe the first problem of ``base5`` bytes (1-D ``uint8``) for ``numel`` values:
    their count, a group number above 124, non-zero unused slots or bits; ``None`` if valid."""
    need = packed_size_base5(numel)
    if source.size != need:
        return f"{source.size} code bytes for {numel} values (need {need})"
    if numel == 0:
        return None
    blocks, count = -(-numel // BLOCK_VALUES), -(-numel // 3)
    last = 0
    for start, chunk in _chunks(source, 0, blocks):
        groups = chunk.reshape(-1)[: count - start * _GROUPS]
        if bool((groups > 124).any()):
            return "invalid base-5 group (> 124)"
        last = int(groups[-1])
    used = numel % 3
    if used and last >= 5**used:
        return "non-zero padding in the last code group"
    spare = 8 * need - 7 * count
    if spare and int(source[-1]) >> (8 - spare):
        return "non-zero padding in the last code byte"
    return None


def invalid_base5_rows(rows: np.ndarray[Any, Any], numel: int) -> bool:
    """Whether :func:`invalid_base5` finds a problem in any row of ``rows`` (2-D ``uint8``,
    one tensor's bytes per row)."""
    if rows.ndim != 2 or rows.shape[1] != packed_size_base5(numel):
        return True
    return any(invalid_base5(row, numel) is not None for row in rows)
