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
* :func:`lane_statistics`: the float64 lane sums of
  :mod:`fedddl.compression.statistics`, written as LLVM vector operations
  (numba's own loops leave these additions scalar, since it may not reorder
  them; the lanes fix the order, so a vector add per step is exact).

All kernels release the GIL, so the package's thread pool runs them in parallel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "LANES",
    "lane_statistics",
    "pcg64dxsm_words",
    "ternarize_pack",
    "unpack_2bit",
    "unpack_base3",
]

#: The 64-bit multiplier of PCG64DXSM's LCG step and output function (numpy's constant).
PCG_CHEAP_MULTIPLIER = 0xDA942042E4DD58B5
_BLOCK = 4000  # values per block of ternarize_pack: a multiple of 4 (words) and 5 (bytes)
#: Independent LCG chains a whole block's random words are drawn with: each 128-bit LCG
#: step waits for the previous one, so one chain leaves the multipliers idle; chain ``c``
#: starts ``c * _CHAIN_WORDS`` words into the block (a jump ahead) and draws its own
#: quarter, so the words, hence the codes, are those of one chain drawn in order.
_CHAINS = 4
_CHAIN_WORDS = _BLOCK // 4 // _CHAINS
_LOW64 = (1 << 64) - 1


def _jump_constants(words: int) -> tuple[int, int, int, int]:
    """``(A, G)`` as high/low words, with ``A = M**words`` and ``G = M**(words-1) + .. + 1``
    (mod ``2**128``): ``words`` LCG steps take state ``s`` to ``A * s + G * increment``."""
    a, g = 1, 0
    for _ in range(words):
        a = a * PCG_CHEAP_MULTIPLIER % (1 << 128)
        g = (g * PCG_CHEAP_MULTIPLIER + 1) % (1 << 128)
    return a >> 64, a & _LOW64, g >> 64, g & _LOW64


_JUMP_A_HI, _JUMP_A_LO, _JUMP_G_HI, _JUMP_G_LO = _jump_constants(_CHAIN_WORDS)


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
def _mul128(a_hi: np.uint64, a_lo: np.uint64, b_hi: np.uint64, b_lo: np.uint64) -> Any:
    """``a * b`` mod ``2**128`` as ``(high, low)``."""
    high = _mulhi(a_lo, b_lo) + a_hi * b_lo + a_lo * b_hi  # type: ignore[call-arg]
    return high, a_lo * b_lo


@njit(nogil=True, cache=True, inline="always")  # type: ignore[misc]
def _jump(hi: np.uint64, lo: np.uint64, c_hi: np.uint64, c_lo: np.uint64) -> Any:
    """The state ``_CHAIN_WORDS`` steps after ``(hi, lo)``; ``c = G * increment``."""
    hi, lo = _mul128(hi, lo, np.uint64(_JUMP_A_HI), np.uint64(_JUMP_A_LO))
    low = lo + c_lo
    return hi + c_hi + np.uint64(low < lo), low


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
    c_hi, c_lo = _mul128(inc_hi, inc_lo, np.uint64(_JUMP_G_HI), np.uint64(_JUMP_G_LO))
    for start in range(0, n, _BLOCK):
        size = min(_BLOCK, n - start)
        if size == _BLOCK:  # four chains, each a quarter of the block (see _CHAINS)
            h1, l1 = _jump(hi, lo, c_hi, c_lo)
            h2, l2 = _jump(h1, l1, c_hi, c_lo)
            h3, l3 = _jump(h2, l2, c_hi, c_lo)
            for w in range(_CHAIN_WORDS):
                word0, hi, lo = _draw(hi, lo, inc_hi, inc_lo)
                word1, h1, l1 = _draw(h1, l1, inc_hi, inc_lo)
                word2, h2, l2 = _draw(h2, l2, inc_hi, inc_lo)
                word3, h3, l3 = _draw(h3, l3, inc_hi, inc_lo)
                _store(rand, 4 * w, word0)
                _store(rand, 4 * (w + _CHAIN_WORDS), word1)
                _store(rand, 4 * (w + 2 * _CHAIN_WORDS), word2)
                _store(rand, 4 * (w + 3 * _CHAIN_WORDS), word3)
            hi, lo = h3, l3  # the last chain ends where the block's words end
        else:
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


#: Lanes of :func:`lane_statistics`: value ``i`` of a chunk is added to lane ``i mod LANES``.
LANES = 16


@intrinsic  # type: ignore[misc]
def _vector_lane_sums(typingctx: Any, values: Any, whole: Any, sums: Any, peaks: Any) -> Any:
    """Over ``values[:whole]`` (a multiple of :data:`LANES`): ``sums[:LANES]`` and
    ``sums[LANES:]`` the float64 lane sums of the values and of their squares, ``peaks``
    the float32 lane maxima of ``|value|`` (NaN ignored; the sums catch it)."""
    del typingctx
    signature = types.void(values, types.intp, sums, peaks)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        sums_out = context.make_array(sig.args[2])(context, builder, args[2]).data
        peaks_out = context.make_array(sig.args[3])(context, builder, args[3]).data
        count = args[1]
        intp = count.type
        narrow = ir.VectorType(ir.FloatType(), LANES)
        wide = ir.VectorType(ir.DoubleType(), LANES)
        fabs = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(narrow, [narrow]), f"llvm.fabs.v{LANES}f32"
        )
        maxnum = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(narrow, [narrow, narrow]), f"llvm.maxnum.v{LANES}f32"
        )
        zero_wide = ir.Constant(wide, [0.0] * LANES)
        zero_narrow = ir.Constant(narrow, [0.0] * LANES)
        entry = builder.block
        loop = builder.append_basic_block("lanes.loop")
        done = builder.append_basic_block("lanes.done")
        builder.cbranch(builder.icmp_signed(">", count, ir.Constant(intp, 0)), loop, done)

        builder.position_at_end(loop)
        index, total, square, peak = (
            builder.phi(intp),
            builder.phi(wide),
            builder.phi(wide),
            builder.phi(narrow),
        )
        x = builder.load(builder.bitcast(builder.gep(data, [index]), narrow.as_pointer()), align=4)
        w = builder.fpext(x, wide)
        next_total = builder.fadd(total, w)
        next_square = builder.fadd(square, builder.fmul(w, w))  # exact product: no FMA issue
        next_peak = builder.call(maxnum, [peak, builder.call(fabs, [x])])
        next_index = builder.add(index, ir.Constant(intp, LANES))
        builder.cbranch(builder.icmp_signed("<", next_index, count), loop, done)
        for phi, start, step in (
            (index, ir.Constant(intp, 0), next_index),
            (total, zero_wide, next_total),
            (square, zero_wide, next_square),
            (peak, zero_narrow, next_peak),
        ):
            phi.add_incoming(start, entry)
            phi.add_incoming(step, loop)

        builder.position_at_end(done)
        results = []
        for start, step in ((zero_wide, next_total), (zero_wide, next_square)):
            result = builder.phi(wide)
            result.add_incoming(start, entry)
            result.add_incoming(step, loop)
            results.append(result)
        final_peak = builder.phi(narrow)
        final_peak.add_incoming(zero_narrow, entry)
        final_peak.add_incoming(next_peak, loop)
        builder.store(results[0], builder.bitcast(sums_out, wide.as_pointer()), align=8)
        squares_out = builder.gep(sums_out, [ir.Constant(intp, LANES)])
        builder.store(results[1], builder.bitcast(squares_out, wide.as_pointer()), align=8)
        builder.store(final_peak, builder.bitcast(peaks_out, narrow.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


@njit(nogil=True, cache=True)  # type: ignore[misc]
def lane_statistics(values: np.ndarray, out: np.ndarray) -> None:
    """``out[0, j]``, ``out[1, j]``: float64 sums of the float32 ``values`` and of their
    squares in lane ``j`` (values ``i = j mod LANES``, added in order; the last
    ``size mod LANES`` values continue lanes ``0, 1, ..``); ``out[2, 0]``: ``max |value|``.

    Squares of float32 values are exact in float64, so only the additions round, and
    their order is fixed by the lanes (:mod:`fedddl.compression.statistics` computes the
    same sums with numpy).  A NaN or infinite value makes its lane's sum non-finite.
    """
    sums = np.empty(2 * LANES, dtype=np.float64)
    peaks = np.empty(LANES, dtype=np.float32)
    whole = values.size - values.size % LANES
    _vector_lane_sums(values, whole, sums, peaks)  # type: ignore[call-arg]
    peak = peaks.max()
    for j in range(LANES):
        out[0, j] = sums[j]
        out[1, j] = sums[LANES + j]
    for j in range(values.size - whole):
        wide = np.float64(values[whole + j])
        out[0, j] += wide
        out[1, j] += wide * wide
        peak = max(peak, abs(values[whole + j]))
    out[2, 0] = peak
