"""A reusable byte buffer that messages are encoded into
(``encode_update(..., into=buffer)``) instead of new ``bytes``, so a process that encodes
large messages one after another keeps its pages mapped instead of faulting in fresh ones.

The returned view is valid until the next message is written into the same buffer; a
buffer holds one message at a time, so concurrent encoders each keep their own.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from fedddl.compression.backends.jit import jit_kernels
from fedddl.compression.backends.parallel import run_units
from fedddl.compression.backends.statistics import all_finite_array
from fedddl.framing import CRC, crc32, crc32_combine

__all__ = ["MessageBuffer", "NonFiniteValues"]

_PIECE = 1 << 19  # bytes copied (and checksummed) at a time: stays in L2 for the CRC
_THREAD_BYTES = 1 << 22  # at least this many bytes per thread
_GROWTH = 1.25  # capacity factor when the buffer must grow, so sizes that creep up rarely move it


class NonFiniteValues(ValueError):
    """A part that :meth:`MessageBuffer.write` was to check holds a NaN or an infinity."""

    def __init__(self, part: int) -> None:
        super().__init__(f"part {part} has NaN or Inf values")
        self.part = part


class MessageBuffer:
    """Memory for one message at a time, reused by every :meth:`write`."""

    def __init__(self) -> None:
        self._memory: np.ndarray[Any, Any] = np.empty(0, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds without growing."""
        return int(self._memory.size)

    def write(
        self,
        parts: Sequence[bytes | bytearray | memoryview],
        size: int,
        *,
        finite_float32: Collection[int] = (),
        seal: bool = False,
    ) -> memoryview:
        """Copy ``parts`` one after the other (``size`` bytes in all); return the bytes.

        The parts whose indices are in ``finite_float32`` are float32 values checked
        finite while they are copied (one pass instead of a check and a copy).  With
        ``seal`` the last :data:`~fedddl.framing.CRC` bytes of ``size`` are the CRC-32 of
        the parts, computed on each piece just written, while it is still in cache (on
        this project's VMs that saves a third of a separate copy and CRC pass).

        Raises
        ------
        NonFiniteValues
            Naming the first checked part with a NaN or an infinity.
        ValueError
            If the parts do not add up to ``size`` bytes (nothing is returned).
        """
        views = [memoryview(part).cast("B") for part in parts]
        body = size - CRC.size if seal else size
        if sum(view.nbytes for view in views) != body:
            raise ValueError(f"parts of {sum(v.nbytes for v in views)} bytes, declared {body}")
        if size > self._memory.size:
            self._memory = np.empty(max(size, int(self._memory.size * _GROWTH)), dtype=np.uint8)
            self._memory.fill(0)  # fault every page in now, once
        kernels = jit_kernels(size // 4)
        checked = set(finite_float32)
        pieces = []  # (part, source piece, where it goes)
        at = 0
        for k, view in enumerate(views):
            if view.nbytes:
                source = np.frombuffer(view, dtype=np.uint8)
                pieces += [
                    (k, source[lo : lo + _PIECE], at + lo) for lo in range(0, view.nbytes, _PIECE)
                ]
            at += view.nbytes
        memory: Any = self._memory
        checksums: list[tuple[int, int, int]] = []  # (first piece, CRC, bytes) per thread
        bad: list[int] = []

        def work(first: int, stop: int) -> None:
            crc, length = 0, 0
            for k, piece, where in pieces[first:stop]:
                target = memory[where : where + piece.size]
                if k not in checked:
                    np.copyto(target, piece)
                elif not _copy_finite32(target.view(np.uint32), piece.view(np.uint32), kernels):
                    bad.append(k)
                    return
                if seal:
                    crc = crc32(target, crc)
                    length += piece.size
            checksums.append((first, crc, length))

        run_units(work, [piece.size for _, piece, _ in pieces], _THREAD_BYTES)
        if bad:
            raise NonFiniteValues(min(bad))
        if seal:
            crc = 0
            for _, piece_crc, length in sorted(checksums):
                crc = crc32_combine(crc, piece_crc, length)
            CRC.pack_into(memory, body, crc)
        filled: Any = self._memory[:size]
        return memoryview(filled).cast("B")


def _copy_finite32(
    target: np.ndarray[Any, Any], source: np.ndarray[Any, Any], kernels: ModuleType | None
) -> bool:
    """Copy ``uint32`` bit patterns of float32 values; whether every value is finite."""
    if kernels is not None:
        return bool(kernels.copy_finite32(source, target))
    np.copyto(target, source)
    return all_finite_array(target.view(np.float32))
