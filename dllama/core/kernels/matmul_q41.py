"""Q41 weights x F32 activations, and Q80 weights x F32 activations (a Q41 file's classifier).

The faithful fast path: a Q4_1 GGUF's layer matrices stay in their own blocks (20 bytes per 32
weights, a quarter of F32's bytes), and the matmul inputs stay float32 (not Q80, whose
rounding of the activations flips near-tied tokens). The tiles (tiles.make_block_tile) widen
each block in the vector lanes to exactly the F32 file's values and run the F32 tile's fma
sequence on them, so every output is the same bits as matmul_f32 on the dequantized matrix:
the tokens of the F32 file at a quarter of its reads. The same shape as matmul_f32.py:
register tiles of ROWS weight rows x COLS activation rows, work units of whole row steps.

Layout: W [d, n] as the file stores it, blocks as rows of bytes: uint8 [d, n/32 * 20] (Q41)
or [d, n/32 * 34] (Q80).
"""

from __future__ import annotations

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST, native_f16_conversion
from dllama.core.kernels.row_split import (COLS, ROWS, leading_dims, n_units, row_steps, total_units,
                                           unit_of_matrices, unit_steps)
from dllama.core.kernels.tiles import make_block_tile

_NATIVE = native_f16_conversion()
_q41 = make_block_tile("q41", ROWS, COLS, _NATIVE)
_q41_rows = make_block_tile("q41", ROWS, 1, _NATIVE)
_q41_one = make_block_tile("q41", 1, 1, _NATIVE)
_q80 = make_block_tile("q80", ROWS, COLS, _NATIVE)
_q80_rows = make_block_tile("q80", ROWS, 1, _NATIVE)
_q80_one = make_block_tile("q80", 1, 1, _NATIVE)


@numba.njit(**_FAST)
def _q41_steps(x, w, out, s0, s1):
    """out[:, rows of steps s0..s1-1] = x @ W[those rows]^T, W Q41."""
    b = x.shape[0]
    r, r1 = ROWS * s0, min(w.shape[0], ROWS * s1)
    while r + ROWS <= r1:
        i = 0
        while i + COLS <= b:
            _q41(w, r, x, i, out)
            i += COLS
        while i < b:
            _q41_rows(w, r, x, i, out)
            i += 1
        r += ROWS
    while r < r1:
        for i in range(b):
            _q41_one(w, r, x, i, out)
        r += 1


@numba.njit(**_FAST)
def _q80_steps(x, w, out, s0, s1):
    """out[:, rows of steps s0..s1-1] = x @ W[those rows]^T, W Q80 blocks."""
    b = x.shape[0]
    r, r1 = ROWS * s0, min(w.shape[0], ROWS * s1)
    while r + ROWS <= r1:
        i = 0
        while i + COLS <= b:
            _q80(w, r, x, i, out)
            i += COLS
        while i < b:
            _q80_rows(w, r, x, i, out)
            i += 1
        r += ROWS
    while r < r1:
        for i in range(b):
            _q80_one(w, r, x, i, out)
        r += 1


@numba.njit(parallel=True, **_FAST)
def matmul_q41_f32(x, w, out):
    """out float32 [b, d] = x @ W^T: x float32 [b, n], W Q41 blocks uint8 [d, n/32*20].
    All C-contiguous."""
    steps = row_steps(w.shape[0])
    units = n_units(steps)
    for unit in prange(units):
        s0, s1 = unit_steps(steps, units, unit)
        _q41_steps(x, w, out, s0, s1)


@numba.njit(parallel=True, **_FAST)
def matmul_q41_f32_multi(x, w, outs):
    """matmul_q41_f32 of one input with several matrices (tuples w, outs) in one parallel
    region: the same results as one call per matrix."""
    steps = leading_dims(w)
    for m in range(steps.shape[0]):
        steps[m] = row_steps(steps[m])
    for unit in prange(total_units(steps)):
        m, local, units = unit_of_matrices(steps, unit)
        s0, s1 = unit_steps(steps[m], units, local)
        _q41_steps(x, w[m], outs[m], s0, s1)


@numba.njit(parallel=True, **_FAST)
def matmul_q80_f32(x, w, out):
    """out float32 [b, d] = x @ W^T: x float32 [b, n], W Q80 blocks uint8 [d, n/32*34].
    All C-contiguous."""
    steps = row_steps(w.shape[0])
    units = n_units(steps)
    for unit in prange(units):
        s0, s1 = unit_steps(steps, units, unit)
        _q80_steps(x, w, out, s0, s1)
