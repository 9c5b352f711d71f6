"""The blockwise codecs' loops (int8, int4: ALGORITHM.md sections 9 and 10), compiled by numba: each block is read
once and finished while it is in cache, where torch makes a pass over the vector per operation (issue #13: codecs
at memory speed). Pure functions on 1-D numpy views of contiguous memory whose length is a whole number of blocks.

The float arithmetic is IEEE float32 in the order written (no fast-math), so the value an encoder adds to its own
copy (`quantize_toward`, `subtract`) is the decoder's q·s bit for bit.

Block b of x (its `bs` values): a = max |x_i|, s = a / qmax, q_i = rint(x_i · (qmax / a)), rounding half to even
(0 for an all-zero block, or when qmax / a overflows), so |q_i| <= qmax. a is found on the float bits with the sign
masked off: for non-negative floats integer order is float order, and every NaN pattern is above +inf's, so a bit
pattern >= `NON_FINITE` means the block held a NaN or an infinity. int8 stores q_i as a byte; int4 stores q_i + 8
as a nibble, the even element in the low one.

The state checksum's terms (`diloco.core.checksum`, which defines it: 32x32-bit products of each value's bits and
its weight, summed in 64 bits per period, times the period's key): the fused kernels return the terms of what they
rewrite, taken while the block is in cache (the old ones only when asked: a range of a larger vector)."""

from __future__ import annotations

import numpy as np
from numba import njit

from diloco.core.checksum import PERIOD, WEIGHTS

NON_FINITE = 0x7F800000  # the bit pattern of +inf: an |x| pattern at or above it is inf or NaN

# The helpers run once per block and are inlined (`inline="always"`): a call per block costs more than the block, and
# array views are taken once per kernel call, outside the block loop (a view per block keeps the loops scalar).
# An index the compiler cannot prove non-negative (`o + i`, `w + i`) is cast with `U`: numba wraps a negative signed
# index, a compare and select per access, and `checksum_term`'s loop gathered its values one by one (2.2x slower).
U = np.uint64
# Small integers stay 32 bits wide only when cast back (`np.uint32(...)` around a masked value): numba computes integer
# arithmetic in 64 bits, and a 64-bit abs-max runs 4 lanes to a vector (a compare and a blend) where `max` on uint32
# is one instruction on 8.
ABS = np.uint32(0x7FFFFFFF)  # masks a float's sign bit off
# The checksum's weights as pairs (element 2j in the low half, little-endian): a term over a kernel's own block
# buffer, viewed the same way, multiplies the halves (32x32 -> 64 bits, one instruction for 4 products) with no
# widening of each value first.
WEIGHT_PAIRS = WEIGHTS.view(np.uint64)
LOW = np.uint64(0xFFFFFFFF)
HIGH = np.uint64(32)


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", inline="always")
def _scale(
    block_bits: np.ndarray, b: int, scales: np.ndarray, scale_bits: np.ndarray, qmax: int
) -> tuple[np.uint32, np.float32, np.float32]:
    """Block b's abs-max bit pattern (`block_bits`: its values as uint32); writes its scale s to scales[b]
    (`scale_bits`: the same memory as int32) and returns (pattern, s, qmax / a)."""
    m = np.uint32(0)
    for i in range(block_bits.size):
        m = max(m, np.uint32(block_bits[i] & ABS))
    scale_bits[b] = m  # a, as a float
    a = scales[b]
    s = a / np.float32(qmax)
    scales[b] = s
    inv = np.float32(qmax) / a if m != 0 else np.float32(0.0)
    return m, s, (inv if inv != np.inf else np.float32(0.0))


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", inline="always")
def _pack(x: np.ndarray, inv: np.float32, qmax: int, packed: np.ndarray, q8: np.ndarray, o: int) -> None:
    """The q of block x (starting at element o of the vector) into its bytes of `packed` (uint8; `q8`: the same
    memory as int8)."""
    if qmax > 7:
        q = q8[o : o + x.size]
        for i in range(x.size):
            q[i] = np.int32(np.rint(x[i] * inv))
    else:
        q = packed[o // 2 : (o + x.size) // 2]
        for i in range(x.size // 2):
            lo = np.int32(np.rint(x[2 * i] * inv)) + 8
            hi = np.int32(np.rint(x[2 * i + 1] * inv)) + 8
            q[i] = lo | (hi << 4)


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", inline="always")
def _key(element: int) -> np.uint64:
    """K of the period holding `element` (an absolute index): splitmix64 of the period number, made odd."""
    z = np.uint64(element // PERIOD) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", inline="always")
def _pair(
    old_bits: np.ndarray, old_lo: int, new_bits: np.ndarray, new_lo: int, count: int, element: int, with_old: bool
) -> tuple[np.uint64, np.uint64]:
    """The terms of `count` values before (`old_bits[old_lo:]`, 0 unless `with_old`) and after (`new_bits[new_lo:]`)
    they were rewritten, within one period: each weight loaded once for both."""
    w = element % PERIOD
    old, new = np.uint64(0), np.uint64(0)
    if with_old:
        for i in range(count):
            weight = np.uint64(WEIGHTS[U(w + i)])
            old += np.uint64(old_bits[U(old_lo + i)]) * weight
            new += np.uint64(new_bits[U(new_lo + i)]) * weight
    else:
        for i in range(count):
            new += np.uint64(new_bits[U(new_lo + i)]) * np.uint64(WEIGHTS[U(w + i)])
    key = _key(element)
    return old * key, new * key


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", inline="always")
def _block_terms(
    old_bits: np.ndarray, old_lo: int, new_bits: np.ndarray, new_lo: int, count: int, element: int, with_old: bool
) -> tuple[np.uint64, np.uint64]:
    """`_pair` of at most `PERIOD` values, which may straddle two periods (a range of a larger vector, e.g. a
    fragment, starts anywhere)."""
    first = min(count, PERIOD - element % PERIOD)
    old, new = _pair(old_bits, old_lo, new_bits, new_lo, first, element, with_old)
    if first < count:
        o, n = _pair(old_bits, old_lo + first, new_bits, new_lo + first, count - first, element + first, with_old)
        old, new = old + o, new + n
    return old, new


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", inline="always")
def _pairs(new_pairs: np.ndarray, count: int, element: int) -> np.uint64:
    """`_pair`'s new term of a kernel's block buffer (`new_pairs`: its `count` values as uint64) that starts at an
    even `element` and does not straddle a period: two products per pair of values and weights. The kernels take
    it whenever only the new term is asked and their vector starts on a block boundary (blocks divide `PERIOD`)."""
    w, h = element % PERIOD // 2, np.uint64(0)
    for i in range(count // 2):
        v, k = new_pairs[i], WEIGHT_PAIRS[U(w + i)]
        h += (v & LOW) * (k & LOW) + (v >> HIGH) * (k >> HIGH)
    return h * _key(element)


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def checksum_term(x: np.ndarray, element: int) -> np.uint64:
    """The checksum term of float32 values x at absolute indices element, element + 1, ... (`diloco.core.checksum`)."""
    bits = x.view(np.uint32)
    h = np.uint64(0)
    i = 0
    while i < bits.size:
        count = min(bits.size - i, PERIOD - (element + i) % PERIOD)
        h += _pair(bits, i, bits, i, count, element + i, False)[1]
        i += count
    return h


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def quantize(x: np.ndarray, bs: int, qmax: int, scales: np.ndarray, packed: np.ndarray, subtract: bool) -> int:
    """Encode x's blocks into `scales` (float32, one per block) and `packed` (uint8: the values' bytes); with
    `subtract`, x -= q·s in place (what the decoder does not see: error feedback's residual). Returns the largest
    |x| bit pattern (>= NON_FINITE: x held a NaN or an infinity)."""
    bits, scale_bits, q8 = x.view(np.uint32), scales.view(np.int32), packed.view(np.int8)
    worst = 0
    for b in range(x.size // bs):
        o = b * bs
        m, s, inv = _scale(bits[o : o + bs], b, scales, scale_bits, qmax)
        worst = max(worst, int(m))
        block = x[o : o + bs]
        _pack(block, inv, qmax, packed, q8, o)
        if subtract:
            for i in range(bs):
                block[i] -= np.rint(block[i] * inv) * s
    return worst


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def quantize_toward(
    params: np.ndarray,
    shadow: np.ndarray,
    out: np.ndarray,
    bs: int,
    qmax: int,
    scales: np.ndarray,
    packed: np.ndarray,
    element: int,
    with_old: bool,
) -> tuple[int, np.uint64, np.uint64]:
    """Encode params - shadow block by block (as `quantize`) and write out = shadow + q·s, the decoded value a
    receiver adds to its shadow. Returns the largest |params - shadow| bit pattern and the checksum terms of shadow
    (before; 0 unless `with_old`) and out (after), the vectors starting at absolute index `element`."""
    diff = np.empty(bs, dtype=np.float32)
    scale_bits, q8 = scales.view(np.int32), packed.view(np.int8)
    old_bits, new_bits, new_pairs = shadow.view(np.uint32), diff.view(np.uint32), diff.view(np.uint64)
    worst, old, new, by_pairs = 0, np.uint64(0), np.uint64(0), not with_old and element % bs == 0
    for b in range(params.size // bs):
        o = b * bs
        for i in range(bs):
            diff[i] = params[U(o + i)] - shadow[U(o + i)]
        m, s, inv = _scale(new_bits, b, scales, scale_bits, qmax)
        worst = max(worst, int(m))
        _pack(diff, inv, qmax, packed, q8, o)
        for i in range(bs):
            diff[i] = shadow[U(o + i)] + np.float32(np.int32(np.rint(diff[i] * inv))) * s
        if by_pairs:
            new += _pairs(new_pairs, bs, element + o)
        else:
            t_old, t_new = _block_terms(old_bits, o, new_bits, 0, bs, element + o, with_old)
            old, new = old + t_old, new + t_new
        for i in range(bs):  # out is often shadow itself: a loop writing one while reading the other stays scalar
            out[U(o + i)] = diff[i]
    return worst, old, new


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def dequantize(packed: np.ndarray, scales: np.ndarray, bs: int, qmax: int, out: np.ndarray) -> None:
    """out = q·s for the blocks of `out` (a whole number; `packed` holds their bytes, `scales` their scales)."""
    q8 = packed.view(np.int8)
    for b in range(out.size // bs):
        o, s = b * bs, scales[b]
        block = out[o : o + bs]
        if qmax > 7:
            q = q8[o : o + bs]
            for i in range(bs):
                block[i] = np.float32(q[i]) * s
        else:
            q = packed[o // 2 : (o + bs) // 2]
            for i in range(bs // 2):
                block[2 * i] = np.float32(np.int32(q[i] & 15) - 8) * s
                block[2 * i + 1] = np.float32(np.int32(q[i] >> 4) - 8) * s


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def dequantize_add(
    packed: np.ndarray, scales: np.ndarray, bs: int, qmax: int, out: np.ndarray, element: int, with_old: bool
) -> tuple[np.uint64, np.uint64]:
    """out += q·s for the blocks of `out` (as `dequantize` into a buffer, then one fp32 add per element: the same
    bits); returns the checksum terms of out before (0 unless `with_old`) and after, `out` starting at absolute
    index `element`. Each block is decoded into a private buffer, and its new values into another, before `out` is
    written: the compiler cannot tell `out` from `packed`, and a loop reading one while writing the other stays
    scalar."""
    q8 = packed.view(np.int8)
    block = np.empty(bs, dtype=np.float32)
    out_bits, new_bits, new_pairs = out.view(np.uint32), block.view(np.uint32), block.view(np.uint64)
    old, new, by_pairs = np.uint64(0), np.uint64(0), not with_old and element % bs == 0
    for b in range(out.size // bs):
        o, s = b * bs, scales[b]
        if qmax > 7:
            for i in range(bs):
                block[i] = np.float32(q8[U(o + i)]) * s
        else:
            for i in range(bs // 2):
                v = packed[U(o // 2 + i)]
                block[2 * i] = np.float32(np.int32(v & 15) - 8) * s
                block[2 * i + 1] = np.float32(np.int32(v >> 4) - 8) * s
        for i in range(bs):
            block[i] = out[U(o + i)] + block[i]
        if by_pairs:
            new += _pairs(new_pairs, bs, element + o)
        else:
            t_old, t_new = _block_terms(out_bits, o, new_bits, 0, bs, element + o, with_old)
            old, new = old + t_old, new + t_new
        for i in range(bs):
            out[U(o + i)] = block[i]
    return old, new
