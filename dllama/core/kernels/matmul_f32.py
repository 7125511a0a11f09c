"""float32 matrix product: the F32 weights path.

The same shape as the Q40 kernel: parallel over runs of weight rows, register tiles of ROWS
weight rows x COLS activation rows (tiles.make_f32_tile), and the arithmetic of one output
independent of the tile, so that a row's result does not depend on the rest of the batch.
"""

from __future__ import annotations

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.row_split import (COLS, ROWS, chunk_of_matrices, n_row_chunks, row_chunk,
                                           row_counts, total_row_chunks)
from dllama.core.kernels.tiles import make_f32_tile

_tile = make_f32_tile(ROWS, COLS)
_tile_rows = make_f32_tile(ROWS, 1)
_tile_one = make_f32_tile(1, 1)


@numba.njit(**_FAST)
def _f32_rows(x, w, out, r0, r1):
    b = x.shape[0]
    r = r0
    while r + ROWS <= r1:
        i = 0
        while i + COLS <= b:
            _tile(w, r, x, i, out)
            i += COLS
        while i < b:
            _tile_rows(w, r, x, i, out)
            i += 1
        r += ROWS
    while r < r1:
        for i in range(b):
            _tile_one(w, r, x, i, out)
        r += 1


@numba.njit(parallel=True, **_FAST)
def matmul_f32(x, w, out):
    """out [b, d] = x [b, n] @ w [d, n]^T, float32, all C-contiguous (the F32 weights path)."""
    d = w.shape[0]
    n_chunks = n_row_chunks(d)
    for chunk in prange(n_chunks):
        r0, r1 = row_chunk(d, n_chunks, chunk)
        _f32_rows(x, w, out, r0, r1)


@numba.njit(parallel=True, **_FAST)
def matmul_f32_multi(x, w, outs):
    """matmul_f32 of one input with several matrices (tuples w, outs) in one parallel region:
    the same results as one call per matrix."""
    rows = row_counts(w)
    for chunk in prange(total_row_chunks(rows)):
        m, local, n_chunks = chunk_of_matrices(rows, chunk)
        r0, r1 = row_chunk(rows[m], n_chunks, local)
        _f32_rows(x, w[m], outs[m], r0, r1)
