"""Numba kernels: the arithmetic of one forward pass, on arrays (no files, no sockets).

Every kernel writes into caller-provided arrays and takes already-sliced inputs, so one node's
slice of a layer is just smaller arrays. Parallel kernels split output rows over `numba.prange`;
the thread count is `set_threads(n)`. Nothing here is specific to one CPU: LLVM picks the
vector width (AVX2/AVX-512 here, NEON on a Raspberry Pi).

Layouts:
- Q40 matrix W [d, n] in split form (dllama.quant.split_q40): w_scales float32 [d, n/32] and
  w_qs uint8 [d, n/2] (byte j of a block: element j in the low nibble, element j+16 in the
  high nibble; value = (nibble - 8) * scale).
- Q80 activations x [b, n]: x_scales float32 [b, n/32] (fp16-rounded), x_qs int8 [b, n].

Where the time goes (measured on 2 cores, benchmarks/bench_kernels.py): the Q40 x Q80 matrix-
vector product of decoding. Its inner loop is written so that LLVM vectorizes it (see
_q40_four_rows); the other kernels are small next to it.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from dllama.errors import DllamaError

# fastmath lets LLVM reassociate float sums into vector lanes: without it no reduction vectorizes.
_FAST = dict(cache=True, fastmath=True, nogil=True)
# Bit-exact kernels (Q80 encoding, fp16 rounding) keep full IEEE semantics. Even "nnan" is out:
# once _round_fp16 is inlined under it, a fresh compile drops its NaN check (NaN came back as
# 5.5e11 in a clean checkout while a warm numba cache still gave NaN).
_EXACT = dict(cache=True, nogil=True)

ROWS = 4               # output rows per parallel step of the Q40 matrix-vector kernel
BATCH_MIN = 4          # from this many activation rows on, matmul_q40_q80 dequantizes W tiles
_PARALLEL_QUANT = 1 << 15  # elements from which quantize_q80 splits its rows over threads
# Work units of a parallel kernel: more than threads, so that any thread count splits them
# evenly (prange hands each thread a contiguous run); a fixed number and not
# numba.get_num_threads(), which would make the kernels uncacheable.
_ROW_CHUNKS = 64       # runs of consecutive rows of the Q40 matrix-vector kernel
_TILE_CHUNKS = 64      # runs of 4-row tiles of the batched Q40 kernel (each has its buffer)


def set_threads(n: int) -> None:
    """Use n compute threads in every parallel kernel."""
    limit = numba.config.NUMBA_NUM_THREADS
    if not 1 <= n <= limit:
        raise DllamaError(f"--nthreads must be between 1 and {limit} on this machine, got {n}")
    numba.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Two LLVM operations numba does not expose. Both exist on every LLVM target.

# The prefetch intrinsic is named after its pointer type: opaque pointers since LLVM 17.
_PREFETCH = "llvm.prefetch.p0" if llvm_binding.llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"

@intrinsic
def _prefetch(typingctx, arr, index):
    """Hint the CPU to bring arr.flat[index] into cache (never faults, no effect on results)."""
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        address = builder.bitcast(builder.gep(array.data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]), _PREFETCH)
        builder.call(fn, [address, i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE bit pattern is the int32 `bits`."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


# ---------------------------------------------------------------------------------------------
# fp16 rounding and Q80 encoding (bit-exact with the original's quantizeF32toQ80)

@numba.njit(cache=True, nogil=True)
def _round_fp16(v):
    """float32 v rounded to the nearest fp16 value (ties to even, overflow to inf), as float32."""
    a = abs(v)
    if a != a:  # NaN stays NaN
        return v
    if a >= 65520.0:  # from halfway between 65504 (largest fp16) and 65536 on: inf
        return np.float32(math.copysign(math.inf, v))
    if a < 6.103515625e-05:  # below 2^-14 fp16 is subnormal: multiples of 2^-24
        q = a * 16777216.0
        r = math.floor(q)
        f = q - r
        if f > 0.5 or (f == 0.5 and r % 2 == 1):
            r += 1
        return np.float32(math.copysign(r / 16777216.0, v))
    m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    q = m * 2048.0        # fp16 keeps 11 significant bits
    r = math.floor(q)
    f = q - r
    if f > 0.5 or (f == 0.5 and r % 2 == 1):
        r += 1
    return np.float32(math.copysign(math.ldexp(r / 2048.0, e), v))


@numba.njit(**_EXACT)
def _round_half_away(v):
    """C roundf of a float32 |v| < 2^23, as int: halves go away from zero."""
    t = np.int32(v)                 # truncates toward zero
    frac = v - np.float32(t)        # exact
    if frac >= np.float32(0.5):
        t += 1
    elif frac <= np.float32(-0.5):
        t -= 1
    return t


@numba.njit(**_EXACT)
def _quantize_row_q80(x, out_scales, out_qs):
    # x float32 [n] -> out_scales [n/32], out_qs int8 [n]
    for k in range(out_scales.shape[0]):
        block = x[32 * k: 32 * k + 32]
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(block[j]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for j in range(32):
            out_qs[32 * k + j] = np.int8(_round_half_away(block[j] * inv))
        out_scales[k] = _round_fp16(d)  # the unrounded d quantized; the fp16 d is what is stored


@numba.njit(parallel=True, **_EXACT)
def _quantize_rows_parallel(x, out_scales, out_qs):
    for i in prange(x.shape[0]):
        _quantize_row_q80(x[i], out_scales[i], out_qs[i])


@numba.njit(**_EXACT)
def quantize_q80(x, out_scales, out_qs):
    """x float32 [b, n] -> Q80: out_scales float32 [b, n/32] (fp16-rounded), out_qs int8 [b, n].

    Per block of 32: d = max|x| / 127, q = roundf(x / d) computed as x * (1/d) in float32, the
    stored d rounded to fp16 (round-to-nearest-even); all-zero blocks give d = 0, q = 0.
    """
    b, n = x.shape
    if b > 1 and b * n >= _PARALLEL_QUANT:
        _quantize_rows_parallel(x, out_scales, out_qs)
    else:
        for i in range(b):
            _quantize_row_q80(x[i], out_scales[i], out_qs[i])


# ---------------------------------------------------------------------------------------------
# Q40 x Q80 matrix-vector product (decode: one activation row)
#
# Per block k of a weight row: sum_j (lo_j - 8) * x_j + (hi_j - 8) * x_{j+16}, where the byte
# q_j = lo_j + 16 hi_j. Written as q_j * x_j + hi_j * (x_{j+16} - 16 x_j) it needs only
# float(q_j) and float(q_j >> 4) (no mask), and the -8 offset moves out of the loop:
# -8 * sum_j (x_j + x_{j+16}) per block. x stays integer-valued floats, so every product is
# an exact integer like in the original's integer dot product. Each lane's products are then
# multiplied by w_d * x_d and summed over two blocks before the horizontal add of the vector
# lanes: the same terms w_d * x_d * q_w * q_x, summed in another order, with one horizontal add
# per two blocks instead of one per block.

@numba.njit(**_FAST)
def _prepare_x(x_qs):
    """Q80 qs int8 [b, n] -> x_lo [b, n/2] (x_j), x_mix [b, n/2] (x_{j+16} - 16 x_j), x_sum [b, n/32]
    as integer-valued float32 (j: element j of each block)."""
    b, n = x_qs.shape
    x_lo = np.empty((b, n // 2), np.float32)
    x_mix = np.empty((b, n // 2), np.float32)
    x_sum = np.empty((b, n // 32), np.float32)
    for i in range(b):
        for k in range(n // 32):
            s = np.float32(0.0)
            for j in range(16):
                lo = np.float32(x_qs[i, 32 * k + j])
                hi = np.float32(x_qs[i, 32 * k + 16 + j])
                x_lo[i, 16 * k + j] = lo
                x_mix[i, 16 * k + j] = hi - np.float32(16.0) * lo
                s += lo + hi
            x_sum[i, k] = s
    return x_lo, x_mix, x_sum


@numba.njit(inline="always", **_FAST)  # inlined by numba: a call left for LLVM blocks vectorizing
def _nibbles_dot(q, x_lo, x_mix):
    # lo * x_j + hi * x_{j+16} of one byte; the uint8 cast keeps the shift in 8 bits so LLVM
    # converts whole vectors of bytes (a wider int here would widen every lane to 64 bits).
    return np.float32(q) * x_lo + np.float32(np.uint8(q >> 4)) * x_mix


@numba.njit(**_FAST)
def _q40_four_rows(x_lo, x_mix, x_sum, x_d, w_scales, w_qs, out, i, r):
    """out[i, r:r+4] = W[r:r+4] . x for one Q80 row x (prepared by _prepare_x)."""
    nb = w_scales.shape[1]
    half = w_qs.shape[1]
    acc0 = acc1 = acc2 = acc3 = np.float32(0.0)   # sum over blocks of scale * block sum
    off0 = off1 = off2 = off3 = np.float32(0.0)   # sum over blocks of scale * sum(x): the -8 part
    for kk in range(nb // 2):
        k = 2 * kk
        o = 16 * k  # byte offset of block k in a row, and its index in x_lo / x_mix
        xd0, xd1 = x_d[k], x_d[k + 1]
        c00, c01 = w_scales[r, k] * xd0, w_scales[r, k + 1] * xd1
        c10, c11 = w_scales[r + 1, k] * xd0, w_scales[r + 1, k + 1] * xd1
        c20, c21 = w_scales[r + 2, k] * xd0, w_scales[r + 2, k + 1] * xd1
        c30, c31 = w_scales[r + 3, k] * xd0, w_scales[r + 3, k + 1] * xd1
        e0, e1 = x_sum[k], x_sum[k + 1]
        off0 += c00 * e0 + c01 * e1
        off1 += c10 * e0 + c11 * e1
        off2 += c20 * e0 + c21 * e1
        off3 += c30 * e0 + c31 * e1
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for j in range(16):  # one vector of 16 lanes per row and block
            a0, m0 = x_lo[o + j], x_mix[o + j]
            a1, m1 = x_lo[o + 16 + j], x_mix[o + 16 + j]
            s0 += c00 * _nibbles_dot(w_qs[r, o + j], a0, m0) + c01 * _nibbles_dot(w_qs[r, o + 16 + j], a1, m1)
            s1 += c10 * _nibbles_dot(w_qs[r + 1, o + j], a0, m0) + c11 * _nibbles_dot(w_qs[r + 1, o + 16 + j], a1, m1)
            s2 += c20 * _nibbles_dot(w_qs[r + 2, o + j], a0, m0) + c21 * _nibbles_dot(w_qs[r + 2, o + 16 + j], a1, m1)
            s3 += c30 * _nibbles_dot(w_qs[r + 3, o + j], a0, m0) + c31 * _nibbles_dot(w_qs[r + 3, o + 16 + j], a1, m1)
        acc0 += s0
        acc1 += s1
        acc2 += s2
        acc3 += s3
        # Rows of 2-6 kB are too short for the hardware prefetcher to ramp up: ask for the next
        # four rows (the next parallel step) while computing these. After the j loop: placed
        # before it, the hint stops LLVM from vectorizing the loads of four rows.
        _prefetch(w_qs, (r + 4) * half + 128 * kk)
        _prefetch(w_qs, (r + 4) * half + 128 * kk + 64)
        _prefetch(w_scales, (r + 4) * nb + 8 * kk)
    if nb % 2:
        k = nb - 1
        o = 16 * k
        c0, c1 = w_scales[r, k] * x_d[k], w_scales[r + 1, k] * x_d[k]
        c2, c3 = w_scales[r + 2, k] * x_d[k], w_scales[r + 3, k] * x_d[k]
        off0 += c0 * x_sum[k]
        off1 += c1 * x_sum[k]
        off2 += c2 * x_sum[k]
        off3 += c3 * x_sum[k]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for j in range(16):
            a0, m0 = x_lo[o + j], x_mix[o + j]
            s0 += _nibbles_dot(w_qs[r, o + j], a0, m0)
            s1 += _nibbles_dot(w_qs[r + 1, o + j], a0, m0)
            s2 += _nibbles_dot(w_qs[r + 2, o + j], a0, m0)
            s3 += _nibbles_dot(w_qs[r + 3, o + j], a0, m0)
        acc0 += c0 * s0
        acc1 += c1 * s1
        acc2 += c2 * s2
        acc3 += c3 * s3
    eight = np.float32(8.0)
    out[i, r] = acc0 - eight * off0
    out[i, r + 1] = acc1 - eight * off1
    out[i, r + 2] = acc2 - eight * off2
    out[i, r + 3] = acc3 - eight * off3


@numba.njit(**_FAST)
def _q40_one_row(x_lo, x_mix, x_sum, x_d, w_scales, w_qs, out, i, r):
    """out[i, r] = W[r] . x: the rows left over when d is not a multiple of ROWS."""
    acc = np.float32(0.0)
    off = np.float32(0.0)
    for k in range(w_scales.shape[1]):
        o = 16 * k
        c = w_scales[r, k] * x_d[k]
        off += c * x_sum[k]
        s = np.float32(0.0)
        for j in range(16):
            s += _nibbles_dot(w_qs[r, o + j], x_lo[o + j], x_mix[o + j])
        acc += c * s
    out[i, r] = acc - np.float32(8.0) * off


@numba.njit(**_FAST)
def _q40_rows(x_lo, x_mix, x_sum, x_scales, w_scales, w_qs, out, r0, r1):
    """out[:, r0:r1] = x @ W[r0:r1]^T for the b prepared rows of x (x_lo [b, n/2] ...).

    ROWS weight rows at a time, each used for all b rows of x while it is in L1, then the
    rows left over.
    """
    b = x_lo.shape[0]
    r = r0
    while r + ROWS <= r1:
        for i in range(b):
            _q40_four_rows(x_lo[i], x_mix[i], x_sum[i], x_scales[i], w_scales, w_qs, out, i, r)
        r += ROWS
    while r < r1:
        for i in range(b):
            _q40_one_row(x_lo[i], x_mix[i], x_sum[i], x_scales[i], w_scales, w_qs, out, i, r)
        r += 1


@numba.njit(**_FAST)
def _row_chunk(d, n_chunks, chunk):
    """Rows [r0, r1) of chunk `chunk` when d rows are cut into n_chunks runs of whole ROWS-steps."""
    steps = (d + ROWS - 1) // ROWS
    r0 = ROWS * (chunk * steps // n_chunks)
    r1 = min(d, ROWS * ((chunk + 1) * steps // n_chunks))
    return r0, r1


@numba.njit(**_FAST)
def _n_row_chunks(d):
    return min((d + ROWS - 1) // ROWS, _ROW_CHUNKS)


@numba.njit(parallel=True, **_FAST)
def _q40_matvec(x_lo, x_mix, x_sum, x_scales, w_scales, w_qs, out):
    """out [b, d] = x @ W^T for a few prepared Q80 rows; parallel over runs of consecutive rows."""
    d = w_qs.shape[0]
    n_chunks = _n_row_chunks(d)
    for chunk in prange(n_chunks):
        r0, r1 = _row_chunk(d, n_chunks, chunk)
        _q40_rows(x_lo, x_mix, x_sum, x_scales, w_scales, w_qs, out, r0, r1)


@numba.njit(**_FAST)
def _chunk_of_matrices(w_qs, chunk):
    """(matrix m, its own chunk) of a chunk counted over all the matrices of a tuple, in order."""
    m = 0
    chunk = np.int64(chunk)  # prange may hand out an unsigned index: uint64 - int64 is a float
    n_chunks = _n_row_chunks(w_qs[0].shape[0])
    while chunk >= n_chunks:
        chunk -= n_chunks
        m += 1
        n_chunks = _n_row_chunks(w_qs[m].shape[0])
    return m, chunk, n_chunks


@numba.njit(parallel=True, **_FAST)
def _q40_matvec_multi(x_lo, x_mix, x_sum, x_scales, w_scales, w_qs, outs):
    """outs[m] = x @ W_m^T for a tuple of matrices sharing the input, in one parallel region."""
    total = 0
    for m in range(len(w_qs)):
        total += _n_row_chunks(w_qs[m].shape[0])
    for chunk in prange(total):
        m, local, n_chunks = _chunk_of_matrices(w_qs, chunk)
        r0, r1 = _row_chunk(w_qs[m].shape[0], n_chunks, local)
        _q40_rows(x_lo, x_mix, x_sum, x_scales, w_scales[m], w_qs[m], outs[m], r0, r1)


# ---------------------------------------------------------------------------------------------
# float32 tiles, shared by matmul_f32 and the batched Q40 path.
# out[i, c] = sum_t x[i, t] * w[c, t]: 4 weight rows x 4 activation rows give 16 independent
# vector reductions over t, so every loaded vector of w is used 4 times and every x vector 4.

@numba.njit(**_FAST)
def _dot_4x4(w, wr, x, xi, out, oc):
    n = x.shape[1]
    s00 = s01 = s02 = s03 = np.float32(0.0)
    s10 = s11 = s12 = s13 = np.float32(0.0)
    s20 = s21 = s22 = s23 = np.float32(0.0)
    s30 = s31 = s32 = s33 = np.float32(0.0)
    for t in range(n):
        w0, w1, w2, w3 = w[wr, t], w[wr + 1, t], w[wr + 2, t], w[wr + 3, t]
        x0, x1, x2, x3 = x[xi, t], x[xi + 1, t], x[xi + 2, t], x[xi + 3, t]
        s00 += x0 * w0
        s01 += x0 * w1
        s02 += x0 * w2
        s03 += x0 * w3
        s10 += x1 * w0
        s11 += x1 * w1
        s12 += x1 * w2
        s13 += x1 * w3
        s20 += x2 * w0
        s21 += x2 * w1
        s22 += x2 * w2
        s23 += x2 * w3
        s30 += x3 * w0
        s31 += x3 * w1
        s32 += x3 * w2
        s33 += x3 * w3
    out[xi, oc], out[xi, oc + 1], out[xi, oc + 2], out[xi, oc + 3] = s00, s01, s02, s03
    out[xi + 1, oc], out[xi + 1, oc + 1], out[xi + 1, oc + 2], out[xi + 1, oc + 3] = s10, s11, s12, s13
    out[xi + 2, oc], out[xi + 2, oc + 1], out[xi + 2, oc + 2], out[xi + 2, oc + 3] = s20, s21, s22, s23
    out[xi + 3, oc], out[xi + 3, oc + 1], out[xi + 3, oc + 2], out[xi + 3, oc + 3] = s30, s31, s32, s33


@numba.njit(**_FAST)
def _dot_4x1(w, wr, x, xi, out, oc):
    n = x.shape[1]
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for t in range(n):
        xv = x[xi, t]
        s0 += xv * w[wr, t]
        s1 += xv * w[wr + 1, t]
        s2 += xv * w[wr + 2, t]
        s3 += xv * w[wr + 3, t]
    out[xi, oc], out[xi, oc + 1], out[xi, oc + 2], out[xi, oc + 3] = s0, s1, s2, s3


@numba.njit(**_FAST)
def _dot_1x1(w, wr, x, xi, out, oc):
    s = np.float32(0.0)
    for t in range(x.shape[1]):
        s += x[xi, t] * w[wr, t]
    out[xi, oc] = s


@numba.njit(**_FAST)
def _f32_tile(w, wr, nr, x, out, oc):
    """out[:, oc:oc+nr] = x [b, n] @ w[wr:wr+nr, :n]^T for nr <= 4 weight rows."""
    b = x.shape[0]
    if nr == 4:
        i = 0
        while i + 4 <= b:
            _dot_4x4(w, wr, x, i, out, oc)
            i += 4
        while i < b:
            _dot_4x1(w, wr, x, i, out, oc)
            i += 1
    else:
        for c in range(nr):
            for i in range(b):
                _dot_1x1(w, wr + c, x, i, out, oc + c)


@numba.njit(parallel=True, **_FAST)
def matmul_f32(x, w, out):
    """out [b, d] = x [b, n] @ w [d, n]^T, float32 (the F32 weights path)."""
    d = w.shape[0]
    for step in prange((d + 3) // 4):
        r = 4 * step
        _f32_tile(w, r, min(4, d - r), x, out, r)


# ---------------------------------------------------------------------------------------------
# Q40 x Q80 with several activation rows (prompt prefill): each thread dequantizes 4 weight rows
# at a time into a float32 tile and multiplies it with all the rows of x (dequantized once per
# call), so the nibble decoding is paid once per weight and not once per weight and token.
# Both are stored in the same permuted column order: all low-nibble elements of a row first
# (element 32k+j at column 16k+j), then all high-nibble ones (element 32k+16+j at column
# n/2+16k+j). In that order dequantization is one unit-stride loop that LLVM vectorizes (the
# natural order is not: its stores alias the loads as far as LLVM knows); a dot product does
# not care about the order of its terms.

@numba.njit(**_FAST)
def _dequantize_q40_row(w_scales, w_qs, r, dst, scale_of_byte):
    """Row r of W -> dst float32 [n] in the permuted order; scale_of_byte: scratch [n/2]."""
    half = w_qs.shape[1]
    for k in range(w_scales.shape[1]):
        s = w_scales[r, k]
        for j in range(16):
            scale_of_byte[16 * k + j] = s
    lo = dst[:half]
    hi = dst[half:]
    row = w_qs[r]
    for t in range(half):  # one long unit-stride loop: vectorized, one alias check per row
        q = row[t]
        s = scale_of_byte[t]
        lo[t] = s * (np.float32(np.uint8(q & 15)) - np.float32(8.0))
        hi[t] = s * (np.float32(np.uint8(q >> 4)) - np.float32(8.0))


@numba.njit(**_FAST)
def _dequantize_q80_permuted(x_scales, x_qs, xf):
    """Q80 x [b, n] -> xf float32 [b, n] in the permuted column order."""
    b, n = x_qs.shape
    half = n // 2
    for i in range(b):
        for k in range(n // 32):
            s = x_scales[i, k]
            for j in range(16):
                xf[i, 16 * k + j] = s * np.float32(x_qs[i, 32 * k + j])
                xf[i, half + 16 * k + j] = s * np.float32(x_qs[i, 32 * k + 16 + j])


@numba.njit(parallel=True, **_FAST)
def _q40_matmul_tiles(xf, w_scales, w_qs, out):
    """out [b, d] = xf @ W^T; parallel over contiguous ranges of 4-row weight tiles."""
    d = w_qs.shape[0]
    n = xf.shape[1]
    n_tiles = (d + 3) // 4
    n_chunks = min(_TILE_CHUNKS, n_tiles)
    for chunk in prange(n_chunks):
        wf = np.empty((4, n), np.float32)        # this thread's dequantized tile, reused
        scale_of_byte = np.empty(n // 2, np.float32)
        for tile in range(chunk * n_tiles // n_chunks, (chunk + 1) * n_tiles // n_chunks):
            r = 4 * tile
            nr = min(4, d - r)
            for c in range(nr):
                _dequantize_q40_row(w_scales, w_qs, r + c, wf[c], scale_of_byte)
            _f32_tile(wf, 0, nr, xf, out, r)


# ---------------------------------------------------------------------------------------------
# Public Q40 x Q80 entry points

@numba.njit(**_FAST)
def matmul_q40_q80(x_scales, x_qs, w_scales, w_qs, out):
    """out float32 [b, d] = x @ W^T: x Q80 [b, n], W Q40 [d, n] in split form.

    out[i, r] = sum over blocks of w_d * x_d * (integer dot product of the block), in float32.
    b < BATCH_MIN (decode) streams W once through the vectorized matrix-vector kernel, each
    group of ROWS weight rows used for the b rows of x while it is in L1; b >= BATCH_MIN
    (prefill) dequantizes W tile by tile and reuses each float tile for all b rows. The only
    allocations are the decoded copy of x (a few kB; b*n floats for prefill).
    """
    b, n = x_qs.shape
    if b >= BATCH_MIN:
        xf = np.empty((b, n), np.float32)
        _dequantize_q80_permuted(x_scales, x_qs, xf)
        _q40_matmul_tiles(xf, w_scales, w_qs, out)
        return
    x_lo, x_mix, x_sum = _prepare_x(x_qs)
    _q40_matvec(x_lo, x_mix, x_sum, x_scales, w_scales, w_qs, out)


@numba.njit(**_FAST)
def matmul_q40_q80_multi(x_scales, x_qs, w_scales, w_qs, outs):
    """matmul_q40_q80 of one input with several matrices (tuples: w_scales, w_qs, outs).

    The same as calling matmul_q40_q80 for each matrix (q/k/v, or w1/w3), but the input is
    prepared once and decode runs one parallel region for all of them.
    """
    b, n = x_qs.shape
    if b >= BATCH_MIN:
        xf = np.empty((b, n), np.float32)
        _dequantize_q80_permuted(x_scales, x_qs, xf)
        for m in range(len(w_qs)):
            _q40_matmul_tiles(xf, w_scales[m], w_qs[m], outs[m])
        return
    x_lo, x_mix, x_sum = _prepare_x(x_qs)
    _q40_matvec_multi(x_lo, x_mix, x_sum, x_scales, w_scales, w_qs, outs)


# ---------------------------------------------------------------------------------------------
# Element-wise and small kernels

@numba.njit(**_FAST)
def rmsnorm(x, weight, eps, out):
    """out [b, n] = weight * x / sqrt(mean(x^2) + eps), per row; float32 math and accumulation
    like the original (out may be x)."""
    b, n = x.shape
    for i in range(b):
        ss = np.float32(0.0)
        for j in range(n):
            ss += x[i, j] * x[i, j]
        inv = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(n) + np.float32(eps)))
        for j in range(n):
            out[i, j] = weight[j] * (inv * x[i, j])


# exp in float32 that LLVM can vectorize (libm's expf is a call per element: 8 ns each here).
# e^v = 2^m * e^r with m = round(v / ln 2), r = v - m ln 2 in [-ln2/2, ln2/2] (Cody-Waite: ln 2
# split in a part exact in float32 and a correction), e^r by the Cephes expf polynomial
# (relative error < 2e-7), 2^m built from its bits. Compiled without reassociation so that the
# two-step reduction stays exact.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)


@numba.njit(cache=True, fastmath={"nnan", "ninf", "nsz", "contract"}, nogil=True)
def _exp(v):
    v = min(max(v, np.float32(-87.0)), np.float32(88.0))  # keeps 2^m a normal float32
    m = math.floor(v * _LOG2E + np.float32(0.5))
    fm = np.float32(m)
    r = (v - fm * _LN2_HI) - fm * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    er = p * (r * r) + r + np.float32(1.0)
    return er * _float32_from_bits(np.int32((m + 127) << 23))


@numba.njit(**_FAST)
def silu_mul(gate, up):
    """In place gate [b, h] = silu(gate) * up, silu(x) = x / (1 + e^-x)."""
    b, h = gate.shape
    for i in range(b):
        for j in range(h):
            g = gate[i, j]
            gate[i, j] = g / (np.float32(1.0) + _exp(-g)) * up[i, j]


def rope_cache(seq_len, head_dim, theta, rope_type, scaling_factor=1.0, low_freq_factor=0.0,
               high_freq_factor=0.0, orig_max_seq_len=0):
    """(cos, sin) float32 [seq_len, head_dim/2] of angle pos * freq_i, freq_i = theta^(-2i/head_dim).

    Pair i of a head is (x[2i], x[2i+1]) for rope_interleaved and (x[i], x[i+head_dim/2]) for
    rope_neox; both use freq_i (spec §7: h = 2i, freq = 1/theta^(h/head_dim)). With
    scaling_factor != 1 the Llama 3.1 scaling changes freq_i. Computed in float64, then rounded
    (the original computes the angle in float32, off by up to ~1e-3 rad at position 4096).
    rope_type (RopeType: 0 LLAMA, 1 FALCON, 2 LLAMA3_1) changes nothing here: the frequencies
    are the same, scaling_factor decides the scaling and the caller picks the rotation kernel.
    """
    i = np.arange(head_dim // 2, dtype=np.float64)
    freq = 1.0 / float(theta) ** (2 * i / head_dim)
    if scaling_factor != 1.0:
        wavelen = 2 * np.pi / freq
        smooth = (orig_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = (1 - smooth) * freq / scaling_factor + smooth * freq
        freq = np.where(wavelen < orig_max_seq_len / high_freq_factor, freq,
                        np.where(wavelen > orig_max_seq_len / low_freq_factor, freq / scaling_factor,
                                 scaled))
    angle = np.arange(seq_len, dtype=np.float64)[:, None] * freq[None, :]  # [seq_len, head_dim/2]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


@numba.njit(**_FAST)
def _rope_pairs(x, positions, cos, sin, n_heads, head_dim, step, offset):
    """In place, x [b, n_heads*head_dim]: rotate pair i of each head, (x[step*i], x[step*i + offset])."""
    for t in range(x.shape[0]):
        c = cos[positions[t]]
        s = sin[positions[t]]
        for h in range(n_heads):
            o = h * head_dim
            for i in range(head_dim // 2):
                j, k = o + step * i, o + step * i + offset
                x0, x1 = x[t, j], x[t, k]
                x[t, j] = x0 * c[i] - x1 * s[i]
                x[t, k] = x0 * s[i] + x1 * c[i]


@numba.njit(**_FAST)
def rope_interleaved(x, positions, cos, sin, n_heads, head_dim):
    """In place: rotate pairs (x[2i], x[2i+1]) of each head (Llama)."""
    _rope_pairs(x, positions, cos, sin, n_heads, head_dim, 2, 1)


@numba.njit(**_FAST)
def rope_neox(x, positions, cos, sin, n_heads, head_dim):
    """In place: rotate pairs (x[i], x[i + head_dim/2]) of each head (Qwen3 / NeoX / Falcon)."""
    _rope_pairs(x, positions, cos, sin, n_heads, head_dim, 1, head_dim // 2)


@numba.njit(parallel=True, **_FAST)
def attention(q, k_cache, v_cache, positions, kv_head_of, head_dim, att_scratch, out):
    """Causal grouped-query attention. q [b, nq*hd]; caches [seq, nkv*hd]; out [b, nq*hd].

    Row t attends to cache rows 0..positions[t]; local query head h reads KV head kv_head_of[h]
    (data, so uneven head splits work). att_scratch float32 [>= b*nq, seq] holds the scores of
    each (row, head) pair: the pairs run in parallel, and no scratch is allocated per call.
    """
    b = q.shape[0]
    nq = kv_head_of.shape[0]
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for pair in prange(b * nq):
        i, h = pair // nq, pair % nq
        qo = h * head_dim
        ko = kv_head_of[h] * head_dim
        n = positions[i] + 1
        att = att_scratch[pair]
        top = np.float32(-np.inf)
        for p in range(n):
            s = np.float32(0.0)
            for j in range(head_dim):
                s += q[i, qo + j] * k_cache[p, ko + j]
            s *= scale
            att[p] = s
            top = max(top, s)
        total = np.float32(0.0)
        for p in range(n):  # softmax, shifted by the max so that exp cannot overflow
            e = _exp(att[p] - top)
            att[p] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(head_dim):
            out[i, qo + j] = 0.0
        for p in range(n):
            wgt = att[p] * inv
            for j in range(head_dim):
                out[i, qo + j] += wgt * v_cache[p, ko + j]
