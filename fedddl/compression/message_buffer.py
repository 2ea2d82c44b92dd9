"""A reusable byte buffer that messages are encoded into, instead of new ``bytes``.

A new message of tens of megabytes is a fresh memory mapping, and every 4 KiB page of
it faults in on first touch: on the 2-vCPU VMs of this project that costs several times
the copy itself (a 45 MB ``bytes`` took 23 ms to fill, a warm buffer 2.7 ms).  A process
that encodes one large message after another (a client, a peer, a benchmark) keeps one
:class:`MessageBuffer` and passes it as ``encode_update(..., into=buffer)``; the buffer
grows to the largest message and its pages stay mapped.

The returned view is valid until the next message is written into the same buffer:
send or copy it before encoding the next one.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from fedddl.compression.jit import jit_kernels
from fedddl.compression.parallel import copy_pieces

__all__ = ["MessageBuffer", "NonFiniteValues"]

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
    ) -> memoryview:
        """Copy ``parts`` (``size`` bytes in all) one after the other; return the bytes.

        The parts are copied in chunks on up to ``torch.get_num_threads()`` threads.  The parts
        whose indices are in ``finite_float32`` are float32 values checked finite while
        they are copied (one pass instead of a check and a copy).

        Raises
        ------
        NonFiniteValues
            Naming the first checked part with a NaN or an infinity.
        ValueError
            If the parts do not add up to ``size`` bytes (nothing is returned).
        """
        views = [memoryview(part).cast("B") for part in parts]
        if sum(view.nbytes for view in views) != size:
            raise ValueError(f"parts of {sum(v.nbytes for v in views)} bytes, declared {size}")
        if size > self._memory.size:
            self._memory = np.empty(max(size, int(self._memory.size * _GROWTH)), dtype=np.uint8)
            self._memory.fill(0)  # fault every page in now, once
        targets, sources, at = [], [], 0
        for view in views:
            targets.append(self._memory[at : at + view.nbytes])
            sources.append(np.frombuffer(view, dtype=np.uint8))
            at += view.nbytes
        kernels = jit_kernels(size // 4)
        checked = set(finite_float32)
        bad: list[int] = []

        def copy(k: int, target: np.ndarray[Any, Any], source: np.ndarray[Any, Any]) -> None:
            if k not in checked:
                np.copyto(target, source)
            elif not _copy_finite32(target.view(np.uint32), source.view(np.uint32), kernels):
                bad.append(k)

        copy_pieces(targets, sources, copy)
        if bad:
            raise NonFiniteValues(min(bad))
        filled: Any = self._memory[:size]
        return memoryview(filled).cast("B")


def _copy_finite32(
    target: np.ndarray[Any, Any], source: np.ndarray[Any, Any], kernels: ModuleType | None
) -> bool:
    """Copy ``uint32`` bit patterns of float32 values; whether every value is finite."""
    if kernels is not None:
        return bool(kernels.copy_finite32(source, target))
    np.copyto(target, source)  # then a SIMD sum: finite iff every value is
    values = target.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow/NaN are what we test
        total = float(np.add.reduce(values))
    if math.isfinite(total):
        return True
    return bool(np.isfinite(values).all())  # a NaN/Inf, or a float32 sum that overflowed
