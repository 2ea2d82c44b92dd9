"""numba versions of the hot loops; import through :mod:`.jit` only.

Each kernel computes bit for bit what the numpy code beside its caller computes (tested):
:func:`pcg64dxsm_words` (numpy's ``PCG64DXSM.random_raw``), :func:`ternarize_pack` (the
stochastic rule of :mod:`.ternarize` in float32, no fused multiply-add, fused with the
random stream and packing), :func:`unpack_base3` / :func:`unpack_2bit` (the tables of
:mod:`.unpacking`) and :func:`lane_statistics` (the float64 lanes of :mod:`.statistics`).
All release the GIL, so the thread pool runs them in parallel. The kernels and the
helpers they inline stay in this one file: numba's on-disk cache keys a compiled kernel on
its own file only, so a helper edited in another file would leave stale cached kernels.
"""

from __future__ import annotations

from collections.abc import Callable
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
#: A whole block's random words are drawn by this many LCG streams side by side in vector
#: registers (one 128-bit LCG step waits for the previous one, so one stream leaves the
#: multipliers idle): stream ``c`` draws words ``c, c + 8, c + 16, ..`` of the block,
#: stepping 8 LCG steps at a time (a jump ahead), so the words, hence the codes, are those
#: of one stream drawn in order.
_WORD_LANES = 8
_LOW64 = (1 << 64) - 1
_LOW32 = (1 << 32) - 1


def _jump_constants(words: int) -> tuple[int, int, int, int]:
    """``(A, G)`` as high/low words, with ``A = M**words`` and ``G = M**(words-1) + .. + 1``
    (mod ``2**128``): ``words`` LCG steps take state ``s`` to ``A * s + G * increment``."""
    a, g = 1, 0
    for _ in range(words):
        a = a * PCG_CHEAP_MULTIPLIER % (1 << 128)
        g = (g * PCG_CHEAP_MULTIPLIER + 1) % (1 << 128)
    return a >> 64, a & _LOW64, g >> 64, g & _LOW64


_JUMP_A_HI, _JUMP_A_LO, _JUMP_G_HI, _JUMP_G_LO = _jump_constants(_WORD_LANES)


def _counted_loop(
    builder: Any, count: Any, step: int, starts: list[Any], body: Callable[..., list[Any]]
) -> list[Any]:
    """Emit ``for index in range(0, count, step)`` carrying values in registers (LLVM
    phis): ``body(index, values)`` emits one step and returns the next values; the
    values after the loop (``starts`` if ``count <= 0``) are returned."""
    intp = count.type
    entry = builder.block
    loop = builder.append_basic_block("loop")
    done = builder.append_basic_block("done")
    builder.cbranch(builder.icmp_signed(">", count, ir.Constant(intp, 0)), loop, done)
    builder.position_at_end(loop)
    index = builder.phi(intp)
    values = [builder.phi(start.type) for start in starts]
    following = body(index, values)
    next_index = builder.add(index, ir.Constant(intp, step))
    end = builder.block
    builder.cbranch(builder.icmp_signed("<", next_index, count), loop, done)
    for phi, start, after in zip(
        [index, *values], [ir.Constant(intp, 0), *starts], [next_index, *following], strict=True
    ):
        phi.add_incoming(start, entry)
        phi.add_incoming(after, end)
    builder.position_at_end(done)
    finals = []
    for start, after in zip(starts, following, strict=True):
        final = builder.phi(start.type)
        final.add_incoming(start, entry)
        final.add_incoming(after, end)
        finals.append(final)
    return finals


def _splat(builder: Any, value: Any, vector: Any) -> Any:
    """A ``vector`` with ``value`` in every lane."""
    undefined = ir.Constant(vector, ir.Undefined)
    one = builder.insert_element(undefined, value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vector.count), [0] * vector.count)
    return builder.shuffle_vector(one, undefined, zeros)


def _pointer_at(builder: Any, base: Any, index: Any, vector: Any) -> Any:
    """``&base[index]`` as a pointer to ``vector``."""
    return builder.bitcast(builder.gep(base, [index]), vector.as_pointer())


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
def _store(rand: np.ndarray, at: int, word: np.uint64) -> None:
    """The word's four 16-bit values, least significant first (numpy's ``view(uint16)``)."""
    rand[at] = np.uint16(word & np.uint64(0xFFFF))
    rand[at + 1] = np.uint16((word >> np.uint64(16)) & np.uint64(0xFFFF))
    rand[at + 2] = np.uint16((word >> np.uint64(32)) & np.uint64(0xFFFF))
    rand[at + 3] = np.uint16(word >> np.uint64(48))


@intrinsic  # type: ignore[misc]
def _vector_words(
    typingctx: Any, lanes_hi: Any, lanes_lo: Any, jump: Any, count: Any, rand: Any
) -> Any:
    """Write ``count`` words (a multiple of :data:`_WORD_LANES`) of the stream to ``rand``
    (``uint16``, four values per word, least significant first).

    ``lanes_hi`` / ``lanes_lo``: the states of the first :data:`_WORD_LANES` words, left
    at the states ``count`` words later; ``jump``: ``A`` and ``C = G * increment`` (high,
    low) of :func:`_jump_constants` for :data:`_WORD_LANES` steps.  Each lane runs
    :func:`_draw`'s output function and the jump in 64-bit vector arithmetic; the high half
    of a 64 x 64-bit product is assembled from four 32 x 32-bit products.
    """
    del typingctx
    signature = types.void(lanes_hi, lanes_lo, jump, types.intp, rand)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        def data(k: int) -> Any:
            return context.make_array(sig.args[k])(context, builder, args[k]).data

        highs, lows, jumps, out = data(0), data(1), data(2), data(4)
        count = args[3]
        intp = count.type
        vector = ir.VectorType(ir.IntType(64), _WORD_LANES)

        def const(value: int) -> Any:
            return ir.Constant(vector, [value] * _WORD_LANES)

        mask, shift = const(_LOW32), const(32)

        def mulhi(x: Any, y_low: Any, y_high: Any) -> Any:
            x_low, x_high = builder.and_(x, mask), builder.lshr(x, shift)
            p00, p01 = builder.mul(x_low, y_low), builder.mul(x_low, y_high)
            p10, p11 = builder.mul(x_high, y_low), builder.mul(x_high, y_high)
            middle = builder.add(
                builder.add(builder.lshr(p00, shift), builder.and_(p01, mask)),
                builder.and_(p10, mask),
            )
            return builder.add(
                builder.add(p11, builder.lshr(p01, shift)),
                builder.add(builder.lshr(p10, shift), builder.lshr(middle, shift)),
            )

        a_hi, a_lo, c_hi, c_lo = (
            _splat(builder, builder.load(builder.gep(jumps, [ir.Constant(intp, k)])), vector)
            for k in range(4)
        )
        a_lo_low, a_lo_high = builder.and_(a_lo, mask), builder.lshr(a_lo, shift)
        multiplier = const(PCG_CHEAP_MULTIPLIER)
        zero = ir.Constant(intp, 0)

        def step(index: Any, state: list[Any]) -> list[Any]:
            hi, lo = state
            word = builder.mul(builder.xor(hi, builder.lshr(hi, shift)), multiplier)
            word = builder.xor(word, builder.lshr(word, const(48)))
            word = builder.mul(word, builder.or_(lo, const(1)))
            at = builder.mul(index, ir.Constant(intp, 4))  # four 16-bit values per word
            builder.store(word, _pointer_at(builder, out, at, vector), align=2)
            product_lo = builder.mul(lo, a_lo)
            product_hi = builder.add(
                mulhi(lo, a_lo_low, a_lo_high),
                builder.add(builder.mul(hi, a_lo), builder.mul(lo, a_hi)),
            )
            next_lo = builder.add(product_lo, c_lo)
            carry = builder.zext(builder.icmp_unsigned("<", next_lo, product_lo), vector)
            return [builder.add(builder.add(product_hi, c_hi), carry), next_lo]

        first = [
            builder.load(_pointer_at(builder, highs, zero, vector), align=8),
            builder.load(_pointer_at(builder, lows, zero, vector), align=8),
        ]
        last_hi, last_lo = _counted_loop(builder, count, _WORD_LANES, first, step)
        builder.store(last_hi, _pointer_at(builder, highs, zero, vector), align=8)
        builder.store(last_lo, _pointer_at(builder, lows, zero, vector), align=8)
        return context.get_dummy_value()

    return signature, codegen


@njit(nogil=True, cache=True)  # type: ignore[misc]
def pcg64dxsm_words(state: np.ndarray, out: np.ndarray) -> None:
    """Fill ``out`` (uint64) with the next words of the stream; advance ``state``."""
    hi, lo, inc_hi, inc_lo = state[0], state[1], state[2], state[3]
    for w in range(out.size):
        out[w], hi, lo = _draw(hi, lo, inc_hi, inc_lo)
    state[0], state[1] = hi, lo


#: Values per vector step of :func:`_vector_codes`.
_CODE_LANES = 16


@intrinsic  # type: ignore[misc]
def _vector_codes(
    typingctx: Any, values: Any, rand: Any, count: Any, factor: Any, limit: Any, codes: Any
) -> Any:
    """``codes[i] = fire + (fire & signbit(g_i))`` for ``i < count`` (a multiple of
    :data:`_CODE_LANES`), ``fire = r_i < min(|g_i| * factor, limit) - 1/2``: the loop of
    :func:`ternarize_pack` as LLVM vector operations, each float32 operation rounded on
    its own as in the scalar loop (numba leaves that loop scalar)."""
    del typingctx
    signature = types.void(values, rand, types.intp, types.float32, types.float32, codes)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        randoms = context.make_array(sig.args[1])(context, builder, args[1]).data
        out = context.make_array(sig.args[5])(context, builder, args[5]).data
        count, factor, limit = args[2], args[3], args[4]
        lanes = _CODE_LANES
        floats = ir.VectorType(ir.FloatType(), lanes)
        words = ir.VectorType(ir.IntType(32), lanes)
        bytes_ = ir.VectorType(ir.IntType(8), lanes)
        fabs = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(floats, [floats]), f"llvm.fabs.v{lanes}f32"
        )
        minnum = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(floats, [floats, floats]), f"llvm.minnum.v{lanes}f32"
        )
        factors, limits = _splat(builder, factor, floats), _splat(builder, limit, floats)
        half = ir.Constant(floats, [0.5] * lanes)
        sign_shift = ir.Constant(words, [31] * lanes)
        sixteen_bits = ir.VectorType(ir.IntType(16), lanes)

        def step(index: Any, carried: list[Any]) -> list[Any]:
            x = builder.load(_pointer_at(builder, data, index, floats), align=4)
            scaled = builder.fmul(builder.call(fabs, [x]), factors)
            level = builder.fsub(builder.call(minnum, [scaled, limits]), half)
            drawn = builder.load(_pointer_at(builder, randoms, index, sixteen_bits), align=2)
            fire = builder.zext(
                builder.fcmp_ordered("<", builder.uitofp(drawn, floats), level), bytes_
            )
            sign = builder.trunc(builder.lshr(builder.bitcast(x, words), sign_shift), bytes_)
            code = builder.add(fire, builder.and_(fire, sign))
            builder.store(code, _pointer_at(builder, out, index, bytes_), align=1)
            return carried

        _counted_loop(builder, count, lanes, [], step)
        return context.get_dummy_value()

    return signature, codegen


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
    jump = np.array([_JUMP_A_HI, _JUMP_A_LO, 0, 0], dtype=np.uint64)
    jump[2], jump[3] = c_hi, c_lo
    lanes_hi = np.empty(_WORD_LANES, dtype=np.uint64)
    lanes_lo = np.empty(_WORD_LANES, dtype=np.uint64)
    for start in range(0, n, _BLOCK):
        size = min(_BLOCK, n - start)
        if size == _BLOCK:  # vector lanes (see _WORD_LANES)
            lane_hi, lane_lo = hi, lo
            for c in range(_WORD_LANES):
                lanes_hi[c], lanes_lo[c] = lane_hi, lane_lo
                _, lane_hi, lane_lo = _draw(lane_hi, lane_lo, inc_hi, inc_lo)
            _vector_words(lanes_hi, lanes_lo, jump, _BLOCK // 4, rand)  # type: ignore[call-arg]
            hi, lo = lanes_hi[0], lanes_lo[0]  # lane 0 ends on the block's next word
        else:
            for w in range((size + 3) // 4):
                word, hi, lo = _draw(hi, lo, inc_hi, inc_lo)
                _store(rand, 4 * w, word)
        chunk = values[start : start + size]
        signs = bits[start : start + size]
        vectored = size - size % _CODE_LANES
        _vector_codes(chunk, rand, vectored, factor, limit, codes)  # type: ignore[call-arg]
        for i in range(vectored, size):
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


@intrinsic  # type: ignore[misc]
def _vector_rows(typingctx: Any, source: Any, count: Any, table: Any, target: Any) -> Any:
    """For ``j < count``: the 8 float32 of table row ``source[j]`` to ``target[5j ..
    5j + 7]``, in increasing ``j``: one 32-byte load and store per byte, the last 3
    values overwritten by the next row (so ``target`` must extend 3 values past
    ``5 * count``)."""
    del typingctx
    signature = types.void(source, types.intp, table, target)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        def data(k: int) -> Any:
            return context.make_array(sig.args[k])(context, builder, args[k]).data

        codes, rows, out = data(0), data(2), data(3)
        count = args[1]
        intp = count.type
        row = ir.VectorType(ir.FloatType(), 8)

        def step(index: Any, carried: list[Any]) -> list[Any]:
            code = builder.zext(builder.load(builder.gep(codes, [index])), intp)
            at_row = builder.mul(code, ir.Constant(intp, 8))
            values = builder.load(_pointer_at(builder, rows, at_row, row), align=4)
            at_out = builder.mul(index, ir.Constant(intp, 5))
            builder.store(values, _pointer_at(builder, out, at_out, row), align=4)
            return carried

        _counted_loop(builder, count, 1, [], step)
        return context.get_dummy_value()

    return signature, codegen


@njit(nogil=True, cache=True)  # type: ignore[misc]
def unpack_base3(source: np.ndarray, table: np.ndarray, target: np.ndarray) -> None:
    """``target[5j .. 5j+4] = table[8 * source[j] .. + 4]`` (rows of 8 float32, 5 used)."""
    n = source.size
    if n == 0:
        return
    _vector_rows(source, n - 1, table, target)  # type: ignore[call-arg]
    row = np.intp(source[n - 1]) * 8  # the last row: exactly 5 values
    for k in range(5):
        target[5 * (n - 1) + k] = table[row + k]


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

        def step(index: Any, carried: list[Any]) -> list[Any]:
            total, square, peak = carried
            x = builder.load(_pointer_at(builder, data, index, narrow), align=4)
            w = builder.fpext(x, wide)
            return [
                builder.fadd(total, w),
                builder.fadd(square, builder.fmul(w, w)),  # exact product: no FMA issue
                builder.call(maxnum, [peak, builder.call(fabs, [x])]),
            ]

        zero_wide = ir.Constant(wide, [0.0] * LANES)
        starts = [zero_wide, zero_wide, ir.Constant(narrow, [0.0] * LANES)]
        total, square, peak = _counted_loop(builder, count, LANES, starts, step)
        builder.store(total, _pointer_at(builder, sums_out, ir.Constant(intp, 0), wide), align=8)
        builder.store(
            square, _pointer_at(builder, sums_out, ir.Constant(intp, LANES), wide), align=8
        )
        builder.store(peak, _pointer_at(builder, peaks_out, ir.Constant(intp, 0), narrow), align=4)
        return context.get_dummy_value()

    return signature, codegen


@njit(nogil=True, cache=True)  # type: ignore[misc]
def lane_statistics(values: np.ndarray, out: np.ndarray) -> None:
    """``out[0, j]``, ``out[1, j]``: float64 sums of the float32 ``values`` and of their
    squares in lane ``j`` (values ``i = j mod LANES``, added in order; the last
    ``size mod LANES`` values continue lanes ``0, 1, ..``); ``out[2, 0]``: ``max |value|``.

    Squares of float32 values are exact in float64, so only the additions round, and
    their order is fixed by the lanes (:mod:`fedddl.compression.backends.statistics` computes the
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


@njit(nogil=True, cache=True)  # type: ignore[misc]
def copy_finite32(source: np.ndarray, target: np.ndarray) -> bool:
    """Copy the ``uint32`` bit patterns of float32 values; return whether all are finite.

    A float32 is NaN or infinite iff its exponent bits are all ones: an integer test
    and an OR, which vectorise (unlike a float sum, whose order numba keeps).
    """
    exponent = np.uint32(0x7F800000)
    bad = np.uint32(0)
    for i in range(source.size):
        value = source[i]
        target[i] = value
        bad |= np.uint32((value & exponent) == exponent)
    return bool(bad == 0)
