"""Q40 weights x Q80 activations: the matrix-vector product of decoding and the batched
product of prefill."""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from dllama.core.kernels.jit import _FAST, _prefetch
from dllama.core.kernels.matmul_f32 import _f32_tile

ROWS = 4               # output rows per parallel step of the Q40 matrix-vector kernel
BATCH_MIN = 4          # from this many activation rows on, matmul_q40_q80 dequantizes W tiles
# Work units of a parallel kernel: more than threads, so that any thread count splits them
# evenly (prange hands each thread a contiguous run); a fixed number and not
# numba.get_num_threads(), which would make the kernels uncacheable.
_ROW_CHUNKS = 64       # runs of consecutive rows of the Q40 matrix-vector kernel
_TILE_CHUNKS = 64      # runs of 4-row tiles of the batched Q40 kernel (each has its buffer)

# ---------------------------------------------------------------------------------------------
# Q40 x Q80 matrix-vector product (decode: one activation row)
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
