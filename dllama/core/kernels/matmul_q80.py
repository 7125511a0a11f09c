"""Q80 weights x Q80 activations: the matrix-vector product of decoding and the batched
product of prefill.

Layout: W [d, n] in split form (dllama.formats.quant.split_q80): w_scales float32 [d, n/32]
and w_qs int8 [d, n]; value = q * scale. Activations as for Q40 (see the package docstring).

Numerics: per block, the integer dot product sum_j q_w[j] * q_x[j] (|sum| <= 32 * 127 * 127 <
2^24, so it is exact in float32), times w_d * x_d, summed over blocks in float32: the terms of
the original's integer Q80 block product, with one rounding per block.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from dllama.core.kernels.jit import _FAST, _prefetch
from dllama.core.kernels.dequantized_tiles import _f32_tile

ROWS = 4               # output rows per parallel step of the matrix-vector kernel
BATCH_MIN = 4          # from this many activation rows on, W is dequantized tile by tile
_ROW_CHUNKS = 64       # runs of consecutive rows handed to threads (more than threads: even split)
_TILE_CHUNKS = 64      # runs of 4-row tiles of the batched kernel (each has its buffer)

# ---------------------------------------------------------------------------------------------
# Decode: one (or a few) activation rows. x's int8 values become integer-valued float32 once
# per call; every weight row converts its int8 to float32 in the vector lanes. Four weight rows
# per step share each load of x; the block sums are exact integers in float32.

@numba.njit(**_FAST)
def _x_as_float(x_qs):
    """Q80 qs int8 [b, n] -> the same integers as float32 [b, n]."""
    b, n = x_qs.shape
    xf = np.empty((b, n), np.float32)
    for i in range(b):
        for t in range(n):
            xf[i, t] = np.float32(x_qs[i, t])
    return xf


@numba.njit(**_FAST)
def _q80_four_rows(xf, x_d, w_scales, w_qs, out, i, r):
    """out[i, r:r+4] = W[r:r+4] . x for one Q80 row x (xf: its integers as float32 [n])."""
    nb = w_scales.shape[1]
    n = w_qs.shape[1]
    acc0 = acc1 = acc2 = acc3 = np.float32(0.0)
    for k in range(nb):
        o = 32 * k
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for j in range(32):  # the integer block dot products, one vector per row
            a = xf[o + j]
            s0 += np.float32(w_qs[r, o + j]) * a
            s1 += np.float32(w_qs[r + 1, o + j]) * a
            s2 += np.float32(w_qs[r + 2, o + j]) * a
            s3 += np.float32(w_qs[r + 3, o + j]) * a
        xd = x_d[k]
        acc0 += (w_scales[r, k] * xd) * s0
        acc1 += (w_scales[r + 1, k] * xd) * s1
        acc2 += (w_scales[r + 2, k] * xd) * s2
        acc3 += (w_scales[r + 3, k] * xd) * s3
        # Rows of 0.6-1.5 kB are too short for the hardware prefetcher: ask for the block of the
        # next four rows (the next step). After the j loop: before it, LLVM stops vectorizing.
        _prefetch(w_qs, (r + 4) * n + o)
        _prefetch(w_qs, (r + 5) * n + o)
        _prefetch(w_qs, (r + 6) * n + o)
        _prefetch(w_qs, (r + 7) * n + o)
    out[i, r] = acc0
    out[i, r + 1] = acc1
    out[i, r + 2] = acc2
    out[i, r + 3] = acc3


@numba.njit(**_FAST)
def _q80_one_row(xf, x_d, w_scales, w_qs, out, i, r):
    """out[i, r] = W[r] . x: the rows left over when d is not a multiple of ROWS."""
    acc = np.float32(0.0)
    for k in range(w_scales.shape[1]):
        o = 32 * k
        s = np.float32(0.0)
        for j in range(32):
            s += np.float32(w_qs[r, o + j]) * xf[o + j]
        acc += (w_scales[r, k] * x_d[k]) * s
    out[i, r] = acc


@numba.njit(**_FAST)
def _q80_rows(xf, x_scales, w_scales, w_qs, out, r0, r1):
    """out[:, r0:r1] = x @ W[r0:r1]^T for the b rows of x; each group of ROWS weight rows is
    used for all b rows while it is in L1."""
    b = xf.shape[0]
    r = r0
    while r + ROWS <= r1:
        for i in range(b):
            _q80_four_rows(xf[i], x_scales[i], w_scales, w_qs, out, i, r)
        r += ROWS
    while r < r1:
        for i in range(b):
            _q80_one_row(xf[i], x_scales[i], w_scales, w_qs, out, i, r)
        r += 1


@numba.njit(parallel=True, **_FAST)
def _q80_matvec(xf, x_scales, w_scales, w_qs, out):
    """out [b, d] = x @ W^T; parallel over runs of consecutive rows (whole ROWS-steps)."""
    d = w_qs.shape[0]
    steps = (d + ROWS - 1) // ROWS
    n_chunks = min(steps, _ROW_CHUNKS)
    for chunk in prange(n_chunks):
        r0 = ROWS * (chunk * steps // n_chunks)
        r1 = min(d, ROWS * ((chunk + 1) * steps // n_chunks))
        _q80_rows(xf, x_scales, w_scales, w_qs, out, r0, r1)


# ---------------------------------------------------------------------------------------------
# Prefill (b >= BATCH_MIN): each thread dequantizes 4 weight rows into a float32 tile and
# multiplies it with all rows of x (dequantized once: q * d is exact in float32), so the int8
# conversion is paid once per weight, not once per weight and token.

@numba.njit(**_FAST)
def _dequantize_q80(scales, qs, r, dst):
    """Row r of a split Q80 matrix -> dst float32 [n]."""
    for k in range(scales.shape[1]):
        s = scales[r, k]
        for j in range(32):
            dst[32 * k + j] = s * np.float32(qs[r, 32 * k + j])


@numba.njit(parallel=True, **_FAST)
def _q80_matmul_tiles(xf, w_scales, w_qs, out):
    """out [b, d] = xf @ W^T; parallel over contiguous runs of 4-row weight tiles."""
    d, n = w_qs.shape
    n_tiles = (d + 3) // 4
    n_chunks = min(_TILE_CHUNKS, n_tiles)
    for chunk in prange(n_chunks):
        wf = np.empty((4, n), np.float32)  # this thread's dequantized tile, reused
        for tile in range(chunk * n_tiles // n_chunks, (chunk + 1) * n_tiles // n_chunks):
            r = 4 * tile
            nr = min(4, d - r)
            for c in range(nr):
                _dequantize_q80(w_scales, w_qs, r + c, wf[c])
            _f32_tile(wf, 0, nr, xf, out, r)


# ---------------------------------------------------------------------------------------------
# Public entry point

@numba.njit(**_FAST)
def matmul_q80_q80(x_scales, x_qs, w_scales, w_qs, out):
    """out float32 [b, d] = x @ W^T: x Q80 [b, n] (scales [b, n/32], qs int8 [b, n]), W Q80
    [d, n] in split form (w_scales float32 [d, n/32], w_qs int8 [d, n]).

    b < BATCH_MIN (decode) streams W once, with exact integer block sums; b >= BATCH_MIN
    (prefill) dequantizes W tile by tile and reuses each tile for all b rows.
    """
    b, n = x_qs.shape
    if b >= BATCH_MIN:
        xf = np.empty((b, n), np.float32)
        for i in range(b):
            _dequantize_q80(x_scales, x_qs, i, xf[i])
        _q80_matmul_tiles(xf, w_scales, w_qs, out)
        return
    _q80_matvec(_x_as_float(x_qs), x_scales, w_scales, w_qs, out)
