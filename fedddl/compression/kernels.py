"""numba versions of the hot loops; import through :mod:`fedddl.compression.jit` only.

Each kernel computes exactly what the numpy code beside its caller computes
(tests compare them bit for bit):

* :func:`pcg64dxsm_words`: numpy's ``PCG64DXSM.random_raw`` (the 128-bit
  "cheap multiplier" LCG step and the DXSM output function), with the state
  kept as four ``uint64`` (state high/low, increment high/low).
* :func:`ternarize_pack`: the stochastic rule of
  :mod:`fedddl.compression.ternarize` in float32 arithmetic (no fused
  multiply-add: numba's default keeps every float32 operation rounded on its
  own), fused with the random stream and with 2-bit or base-3 packing, in
  blocks that stay in L1.
* :func:`unpack_base3` / :func:`unpack_2bit`: the table lookups of
  :mod:`fedddl.compression.packing`.

All kernels release the GIL, so the package's thread pool runs them in parallel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "pcg64dxsm_words",
    "ternarize_pack",
    "unpack_2bit",
    "unpack_base3",
]

#: The 64-bit multiplier of PCG64DXSM's LCG step and output function (numpy's constant).
PCG_CHEAP_MULTIPLIER = 0xDA942042E4DD58B5
_BLOCK = 4000  # values per block of ternarize_pack: a multiple of 4 (words) and 5 (bytes)


@intrinsic  # type: ignore[misc]
def _mulhi(typingctx: Any, a: Any, b: Any) -> Any:
    """High 64 bits of the 128-bit product of two uint64 (one ``mul`` instruction)."""
    del typingctx, a, b
    signature = types.uint64(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        del context, sig
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))

    return signature, codegen


@njit(nogil=True, cache=True, inline="always")  # type: ignore[misc]
def _draw(hi: np.uint64, lo: np.uint64, inc_hi: np.uint64, inc_lo: np.uint64) -> Any:
    """One PCG64DXSM output and the next state: ``(word, hi, lo)``."""
    mul = np.uint64(PCG_CHEAP_MULTIPLIER)
    word = hi ^ (hi >> np.uint64(32))
    word *= mul
    word ^= word >> np.uint64(48)
    word *= lo | np.uint64(1)
    low = lo * mul
    new_lo = low + inc_lo
    carry_in = _mulhi(lo, mul)  # type: ignore[call-arg,var-annotated]
    new_hi = hi * mul + carry_in + inc_hi + np.uint64(new_lo < low)
    return word, new_hi, new_lo


@njit(nogil=True, cache=True, inline="always")  # type: ignore[misc]
def _store(rand: np.ndarray, at: int, word: np.uint64) -> None:
    """The word's four 16-bit values, least significant first (numpy's ``view(uint16)``)."""
    rand[at] = np.uint16(word & np.uint64(0xFFFF))
    rand[at + 1] = np.uint16((word >> np.uint64(16)) & np.uint64(0xFFFF))
    rand[at + 2] = np.uint16((word >> np.uint64(32)) & np.uint64(0xFFFF))
    rand[at + 3] = np.uint16(word >> np.uint64(48))


@njit(nogil=True, cache=True)  # type: ignore[misc]
def pcg64dxsm_words(state: np.ndarray, out: np.ndarray) -> None:
    """Fill ``out`` (uint64) with the next words of the stream; advance ``state``."""
    hi, lo, inc_hi, inc_lo = state[0], state[1], state[2], state[3]
    for w in range(out.size):
        out[w], hi, lo = _draw(hi, lo, inc_hi, inc_lo)
    state[0], state[1] = hi, lo


@njit(nogil=True, cache=True)  # type: ignore[misc]
def ternarize_pack(
    values: np.ndarray,
    state: np.ndarray,
    factor: np.float32,
    limit: np.float32,
    out: np.ndarray,
    base3: bool,
) -> None:
    """Ternarise float32 ``values`` with the stream at ``state`` and pack them into ``out``.

    Value ``i`` fires iff ``r_i < min(|g_i| * factor, limit) - 1/2`` (float32), where
    ``r_i`` is the ``i``-th 16-bit random value; its code is ``1 + signbit(g_i)``.
    ``state`` is advanced by ``ceil(n / 4)`` words.  ``out`` receives
    ``ceil(n / 5)`` (base-3) or ``ceil(n / 4)`` (2-bit) bytes; trailing code slots are 0.
    """
    n = values.size
    bits = values.view(np.uint32)
    hi, lo, inc_hi, inc_lo = state[0], state[1], state[2], state[3]
    rand = np.empty(_BLOCK, dtype=np.uint16)
    codes = np.zeros(_BLOCK, dtype=np.uint8)
    half = np.float32(0.5)
    per = 5 if base3 else 4
    for start in range(0, n, _BLOCK):
        size = min(_BLOCK, n - start)
        for w in range((size + 3) // 4):
            word, hi, lo = _draw(hi, lo, inc_hi, inc_lo)
            _store(rand, 4 * w, word)
        chunk = values[start : start + size]
        signs = bits[start : start + size]
        for i in range(size):
            level = min(abs(chunk[i]) * factor, limit) - half
            fire = np.uint8(np.float32(rand[i]) < level)
            codes[i] = fire + (fire & np.uint8(signs[i] >> np.uint32(31)))
        nbytes = (size + per - 1) // per
        for i in range(size, nbytes * per):
            codes[i] = 0
        first = start // per
        target = out[first : first + nbytes]
        if base3:
            for j in range(nbytes):
                k = 5 * j
                target[j] = (
                    codes[k]
                    + np.uint8(3) * codes[k + 1]
                    + np.uint8(9) * codes[k + 2]
                    + np.uint8(27) * codes[k + 3]
                    + np.uint8(81) * codes[k + 4]
                )
        else:
            for j in range(nbytes):
                k = 4 * j
                target[j] = (
                    codes[k]
                    | (codes[k + 1] << np.uint8(2))
                    | (codes[k + 2] << np.uint8(4))
                    | (codes[k + 3] << np.uint8(6))
                )
    state[0], state[1] = hi, lo


@njit(nogil=True, cache=True)  # type: ignore[misc]
def unpack_base3(source: np.ndarray, table: np.ndarray, target: np.ndarray) -> None:
    """``target[5j .. 5j+4] = table[8 * source[j] .. + 4]`` (rows of 8 float32, 5 used)."""
    for j in range(source.size):
        row = np.intp(source[j]) * 8
        at = 5 * j
        for k in range(5):
            target[at + k] = table[row + k]


@njit(nogil=True, cache=True)  # type: ignore[misc]
def unpack_2bit(source: np.ndarray, table: np.ndarray, target: np.ndarray) -> None:
    """``target[j] = table[source[j]]`` (complex128 entries: 4 float32 each)."""
    for j in range(source.size):
        target[j] = table[source[j]]
