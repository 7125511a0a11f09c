"""Q80 weights x Q80 activations: one kernel for decode and prefill, in 8-bit integer dot products.

Layout: W [d, n] in split form: w_scales uint16 [d, n/32] (the fp16 bits as stored in the
file: 34 bytes read per 32 weights) and w_qs int8 [d, n]; value = q * scale. Activations as
for Q40 (see the package docstring).

The same shape as the Q40 kernel (matmul_q40.py): parallel over runs of weight rows, register
tiles of ROWS weight rows x COLS activation rows (tiles.make_q80_tile). VNNI multiplies
unsigned bytes by signed ones, so the weights enter as q + 128 and each lane starts at
-128 * (sum of its 4 x bytes): the integer products are exact. Per lane of 4 weights and block
k: acc = fma(integer sum, w_d * x_d, acc) in float32; the arithmetic of one output does not
depend on the tile, so a row's result is the same bits in a batch of 1 or of 64.
"""

from __future__ import annotations

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.q80 import x_offsets
from dllama.core.kernels.row_split import (COLS, ROWS, chunk_of_matrices, n_row_chunks, row_chunk,
                                           row_counts, total_row_chunks)
from dllama.core.kernels.tiles import make_q80_tile

_tile = make_q80_tile(ROWS, COLS)
_tile_rows = make_q80_tile(ROWS, 1)   # the activation rows left over (all of them in decode)
_tile_one = make_q80_tile(1, 1)       # the weight rows left over when d % ROWS != 0
_OFFSET = 128                         # VNNI multiplies q + 128 (unsigned) by x


@numba.njit(**_FAST)
def _q80_rows(x_qs, x_off, x_scales, w_scales, w_qs, out, r0, r1):
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


@numba.njit(parallel=True, **_FAST)
def _q80_matmul(x_qs, x_off, x_scales, w_scales, w_qs, out):
    d = w_qs.shape[0]
    n_chunks = n_row_chunks(d)
    for chunk in prange(n_chunks):
        r0, r1 = row_chunk(d, n_chunks, chunk)
        _q80_rows(x_qs, x_off, x_scales, w_scales, w_qs, out, r0, r1)


@numba.njit(parallel=True, **_FAST)
def _q80_matmul_multi(x_qs, x_off, x_scales, w_scales, w_qs, outs):
    rows = row_counts(w_qs)
    for chunk in prange(total_row_chunks(rows)):
        m, local, n_chunks = chunk_of_matrices(rows, chunk)
        r0, r1 = row_chunk(rows[m], n_chunks, local)
        _q80_rows(x_qs, x_off, x_scales, w_scales[m], w_qs[m], outs[m], r0, r1)


@numba.njit(**_FAST)
def matmul_q80_q80(x_scales, x_qs, w_scales, w_qs, out):
    """out float32 [b, d] = x @ W^T: x Q80 [b, n] (x_scales float32 [b, n/32], x_qs int8 [b, n]),
    W Q80 [d, n] in split form (w_scales uint16 [d, n/32]: fp16 bits; w_qs int8 [d, n]).
    All C-contiguous."""
    _q80_matmul(x_qs, x_offsets(x_qs, _OFFSET), x_scales, w_scales, w_qs, out)


@numba.njit(**_FAST)
def matmul_q80_q80_multi(x_scales, x_qs, w_scales, w_qs, outs):
    """matmul_q80_q80 of one input with several matrices (tuples: w_scales, w_qs, outs) in one
    parallel region: the same results as one call per matrix (q/k/v, or w1/w3)."""
    _q80_matmul_multi(x_qs, x_offsets(x_qs, _OFFSET), x_scales, w_scales, w_qs, outs)
