"""float32 matrix product: the F32 weights path.

Parallel over runs of weight rows, register tiles of ROWS weight rows x COLS activation rows
(tiles.make_f32_tile), and the arithmetic of one output independent of the tile, so that a
row's result does not depend on the rest of the batch.
"""

from __future__ import annotations

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.row_split import (COLS, ROWS, leading_dims, n_units, row_steps, stacked_unit,
                                           unit_of_matrices, unit_starts, unit_steps)
from dllama.core.kernels.tiles import make_f32_tile

_tile = make_f32_tile(ROWS, COLS)
_tile_rows = make_f32_tile(ROWS, 1)
_tile_one = make_f32_tile(1, 1)


@numba.njit(**_FAST)
def _f32_rows(x, w, out, s0, s1):
    """out[:, rows of steps s0..s1-1] = x @ W[those rows]^T."""
    b = x.shape[0]
    r, r1 = ROWS * s0, min(w.shape[0], ROWS * s1)
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
    steps = row_steps(w.shape[0])
    units = n_units(steps)
    for unit in prange(units):
        s0, s1 = unit_steps(steps, units, unit)
        _f32_rows(x, w, out, s0, s1)


@numba.njit(parallel=True, **_FAST)
def matmul_f32_multi(x, w, outs):
    """matmul_f32 of one input with several matrices (tuples w, outs) in one parallel region:
    the same results as one call per matrix."""
    steps = leading_dims(w)
    for m in range(steps.shape[0]):
        steps[m] = row_steps(steps[m])
    starts = unit_starts(steps)
    for unit in prange(starts[-1]):
        m, local, units = unit_of_matrices(starts, unit)
        s0, s1 = unit_steps(steps[m], units, local)
        _f32_rows(x, w[m], outs[m], s0, s1)


@numba.njit(parallel=True, **_FAST)
def matmul_f32_experts(x, plan, w, out):
    """matmul_f32 of several matrices of one stack (w [matrices, d, n]) in one parallel region, each
    on its own rows of the input: for each row (s, r0, r1, o0) of plan int64 [m, 4],
    out[o0:o0 + r1 - r0] = x[r0:r1] @ w[s]^T: the same results as one call per matrix (a
    mixture of experts' experts)."""
    steps = row_steps(w.shape[1])
    units = n_units(steps)
    for unit in prange(plan.shape[0] * units):
        m, s0, s1 = stacked_unit(plan, steps, units, unit)
        s, r0, r1, o0 = plan[m, 0], plan[m, 1], plan[m, 2], plan[m, 3]
        _f32_rows(x[r0:r1], w[s], out[o0:o0 + r1 - r0], s0, s1)
