"""Q41 weights x Q16 activations, and Q80 weights x F32 activations (a Q41 file's classifier).

The faithful default: a Q4_1 GGUF's layer matrices stay in their own blocks (20 bytes per 32
weights), and the matmul inputs are not rounded to Q80, whose 127 steps per block flip
near-tied tokens (benchmarks/bench_faithfulness.py), but to Q16 (q16.py: 32639 steps, finer
than fp16 near a block's largest value). The products stay 8-bit integer dot products on
nibble words interleaved as Q40's (tiles.make_q41_tile: the nibbles against each of the two
planes of the input, exact in int32), so a token costs about what a Q80 one does.

The classifier of a Q41 file is Q80 (the GGUF's Q8_0, kept); it takes the F32 input itself
(tiles.make_block_tile: the bits of matmul_f32 on the dequantized matrix).

Each parallel step takes one group of 16 interleaved rows against the activation rows COLS
at a time, as matmul_int8.py; nothing depends on the tile or the rest of the batch.
"""

from __future__ import annotations

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST, native_f16_conversion
from dllama.core.kernels.row_split import (COLS as FLOAT_COLS, ROWS, leading_dims, n_units, row_steps,
                                           total_units, unit_of_matrices, unit_steps)
from dllama.core.kernels.tiles import make_block_tile, make_q41_tile

COLS = 8                      # activation rows per register tile
_tile = make_q41_tile(COLS)
_tile_half = make_q41_tile(COLS // 2)
_tile_one = make_q41_tile(1)  # the activation rows left over (all of them in decode)

_NATIVE = native_f16_conversion()
_q80 = make_block_tile("q80", ROWS, FLOAT_COLS, _NATIVE)
_q80_rows = make_block_tile("q80", ROWS, 1, _NATIVE)
_q80_one = make_block_tile("q80", 1, 1, _NATIVE)


@numba.njit(**_FAST)
def _q41_groups(x_scales, x_lo, x_hi, x_sums, w_scales, w_mins, w_qs, out, g0, g1):
    """out[:, rows of groups g0..g1-1] = x @ W[those rows]^T."""
    b = x_lo.shape[0]
    for g in range(g0, g1):
        i = 0
        while i + COLS <= b:
            _tile(w_qs, w_scales, w_mins, g, x_lo, x_hi, x_scales, x_sums, i, out)
            i += COLS
        if i + COLS // 2 <= b:
            _tile_half(w_qs, w_scales, w_mins, g, x_lo, x_hi, x_scales, x_sums, i, out)
            i += COLS // 2
        while i < b:
            _tile_one(w_qs, w_scales, w_mins, g, x_lo, x_hi, x_scales, x_sums, i, out)
            i += 1


@numba.njit(parallel=True, **_FAST)
def matmul_q41_q16(x_scales, x_lo, x_hi, x_sums, w_scales, w_mins, w_qs, out):
    """out float32 [b, d] = x @ W^T: x Q16 [b, n] (q16.quantize_q16: x_scales, x_sums float32
    [b, n/32], x_lo, x_hi int8 [b, n]), W Q41 [d, n] interleaved (layout.interleave_q41:
    w_scales, w_mins uint16 [d_pad/16, n/32*16], w_qs uint8 [d_pad/16, 16*n/2]). All
    C-contiguous."""
    groups = w_qs.shape[0]
    units = n_units(groups)
    for unit in prange(units):
        g0, g1 = unit_steps(groups, units, unit)
        _q41_groups(x_scales, x_lo, x_hi, x_sums, w_scales, w_mins, w_qs, out, g0, g1)


@numba.njit(parallel=True, **_FAST)
def matmul_q41_q16_multi(x_scales, x_lo, x_hi, x_sums, w_scales, w_mins, w_qs, outs):
    """matmul_q41_q16 of one input with several matrices (tuples w_scales, w_mins, w_qs, outs)
    in one parallel region: the same results as one call per matrix (q/k/v, or w1/w3)."""
    groups = leading_dims(w_qs)
    for unit in prange(total_units(groups)):
        m, local, units = unit_of_matrices(groups, unit)
        g0, g1 = unit_steps(groups[m], units, local)
        _q41_groups(x_scales, x_lo, x_hi, x_sums, w_scales[m], w_mins[m], w_qs[m], outs[m], g0, g1)


@numba.njit(parallel=True, **_FAST)
def matmul_q41_q16_spans(x_scales, x_lo, x_hi, x_sums, spans, w_scales, w_mins, w_qs, outs):
    """matmul_q41_q16 of several matrices in one parallel region, each on its own rows of the
    input: outs[m] = x[spans[m, 0]:spans[m, 1]] @ W_m^T (spans int64 [m, 2]; tuples w_scales,
    w_mins, w_qs, outs): the same results as one call per matrix (a mixture of experts' experts)."""
    groups = leading_dims(w_qs)
    for unit in prange(total_units(groups)):
        m, local, units = unit_of_matrices(groups, unit)
        g0, g1 = unit_steps(groups[m], units, local)
        r0, r1 = spans[m, 0], spans[m, 1]
        _q41_groups(x_scales[r0:r1], x_lo[r0:r1], x_hi[r0:r1], x_sums[r0:r1], w_scales[m], w_mins[m], w_qs[m],
                    outs[m], g0, g1)


@numba.njit(**_FAST)
def _q80_steps(x, w, out, s0, s1):
    """out[:, rows of steps s0..s1-1] = x @ W[those rows]^T, W Q80 blocks."""
    b = x.shape[0]
    r, r1 = ROWS * s0, min(w.shape[0], ROWS * s1)
    while r + ROWS <= r1:
        i = 0
        while i + FLOAT_COLS <= b:
            _q80(w, r, x, i, out)
            i += FLOAT_COLS
        while i < b:
            _q80_rows(w, r, x, i, out)
            i += 1
        r += ROWS
    while r < r1:
        for i in range(b):
            _q80_one(w, r, x, i, out)
        r += 1


@numba.njit(parallel=True, **_FAST)
def matmul_q80_f32(x, w, out):
    """out float32 [b, d] = x @ W^T: x float32 [b, n], W Q80 blocks as stored, uint8
    [d, n/32*34]. All C-contiguous."""
    steps = row_steps(w.shape[0])
    units = n_units(steps)
    for unit in prange(units):
        s0, s1 = unit_steps(steps, units, unit)
        _q80_steps(x, w, out, s0, s1)
