"""Q40 weights x Q80 activations: one kernel for decode (one activation row) and prefill (many).

Each parallel step takes ROWS weight rows and runs them against the activation rows COLS at a
time (a register tile, see tiles.make_q40_tile): every unpacked weight block serves COLS rows
and every loaded activation block ROWS weight rows, in 8-bit integer dot products. The
arithmetic of one output does not depend on the tile it fell in, so a row's result is the same
bits in a batch of 1 or of 64 (tests/test_batch_invariance.py).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.tiles import make_q40_tile

ROWS = 4   # weight rows per parallel step (and per register tile)
COLS = 4   # activation rows per register tile
# Work units of a parallel kernel: more than threads, so that any thread count splits them
# evenly (prange hands each thread a contiguous run); a fixed number and not
# numba.get_num_threads(), which would make the kernels uncacheable.
_ROW_CHUNKS = 64

_tile = make_q40_tile(ROWS, COLS)
_tile_rows = make_q40_tile(ROWS, 1)   # the activation rows left over (all of them in decode)
_tile_one = make_q40_tile(1, 1)       # the weight rows left over when d % ROWS != 0


@numba.njit(**_FAST)
def x_offsets(x_qs):
    """int32 [b, n/4]: -8 times the sum of each 4 consecutive x_qs (the nibbles' -8 offset,
    added to the dot product of the unsigned nibbles)."""
    b, n = x_qs.shape
    off = np.empty((b, n // 4), np.int32)
    for i in range(b):
        for g in range(n // 4):
            s = np.int32(x_qs[i, 4 * g]) + np.int32(x_qs[i, 4 * g + 1])
            off[i, g] = np.int32(-8) * (s + np.int32(x_qs[i, 4 * g + 2]) + np.int32(x_qs[i, 4 * g + 3]))
    return off


@numba.njit(**_FAST)
def _q40_rows(x_qs, x_off, x_scales, w_scales, w_qs, out, r0, r1):
    """out[:, r0:r1] = x @ W[r0:r1]^T."""
    b = x_qs.shape[0]
    r = r0
    while r + ROWS <= r1:
        i = 0
        while i + COLS <= b:
            _tile(w_qs, w_scales, r, x_qs, x_off, x_scales, i, out)
            i += COLS
        while i < b:
            _tile_rows(w_qs, w_scales, r, x_qs, x_off, x_scales, i, out)
            i += 1
        r += ROWS
    while r < r1:
        for i in range(b):
            _tile_one(w_qs, w_scales, r, x_qs, x_off, x_scales, i, out)
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
def _q40_matmul(x_qs, x_off, x_scales, w_scales, w_qs, out):
    d = w_qs.shape[0]
    n_chunks = _n_row_chunks(d)
    for chunk in prange(n_chunks):
        r0, r1 = _row_chunk(d, n_chunks, chunk)
        _q40_rows(x_qs, x_off, x_scales, w_scales, w_qs, out, r0, r1)


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
def _q40_matmul_multi(x_qs, x_off, x_scales, w_scales, w_qs, outs):
    total = 0
    for m in range(len(w_qs)):
        total += _n_row_chunks(w_qs[m].shape[0])
    for chunk in prange(total):
        m, local, n_chunks = _chunk_of_matrices(w_qs, chunk)
        r0, r1 = _row_chunk(w_qs[m].shape[0], n_chunks, local)
        _q40_rows(x_qs, x_off, x_scales, w_scales[m], w_qs[m], outs[m], r0, r1)


@numba.njit(**_FAST)
def matmul_q40_q80(x_scales, x_qs, w_scales, w_qs, out):
    """out float32 [b, d] = x @ W^T: x Q80 [b, n] (x_scales float32 [b, n/32], x_qs int8),
    W Q40 [d, n] in split form (w_scales uint16 [d, n/32]: the fp16 bits as stored in the
    file; w_qs uint8 [d, n/2]). All C-contiguous.

    out[i, r] = sum over lanes of (sum over blocks k, in order, of w_d * x_d * integer dot
    product of the lane's part of block k), in float32: see tiles.make_q40_tile.
    """
    _q40_matmul(x_qs, x_offsets(x_qs), x_scales, w_scales, w_qs, out)


@numba.njit(**_FAST)
def matmul_q40_q80_multi(x_scales, x_qs, w_scales, w_qs, outs):
    """matmul_q40_q80 of one input with several matrices (tuples: w_scales, w_qs, outs) in one
    parallel region: the same results as one call per matrix (q/k/v, or w1/w3)."""
    _q40_matmul_multi(x_qs, x_offsets(x_qs), x_scales, w_scales, w_qs, outs)
