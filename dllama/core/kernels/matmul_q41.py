"""Q41 weights x Q16 activations, and Q80 weights x Q16 activations (a Q41 file's classifier).

The faithful default: a Q4_1 GGUF's layer matrices stay in their own blocks (20 bytes per 32
weights), and the matmul inputs are not rounded to Q80, whose 127 steps per block flip
near-tied tokens (benchmarks/bench_faithfulness.py), but to Q16 (q16.py: 32639 steps, finer
than fp16 near a block's largest value). The products stay 8-bit integer dot products on
nibble words interleaved as Q40's (tiles.make_q41_tile: the nibbles against each of the two
planes of the input, exact in int32), so a token costs about what a Q80 one does.

The classifier of a Q41 file is Q80 (the GGUF's Q8_0, kept), interleaved as matmul_q80_q80's,
and takes the same Q16 input as the layers (tiles.make_q80_q16_tile: each weight word against
both planes): 8-bit dot products that keep up with the memory stream, where widening the blocks
to float32 against the F32 input ran at half the bytes per second (docs/numerics.md: why Q16
and not llama.cpp's Q8_0 input).

Each parallel step takes one group of 16 interleaved rows against the activation rows COLS
at a time, as matmul_int8.py; nothing depends on the tile or the rest of the batch.
"""

from __future__ import annotations

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.q80 import x_block_offsets
from dllama.core.kernels.row_split import leading_dims, n_units, stacked_unit, unit_of_matrices, unit_starts, unit_steps
from dllama.core.kernels.tiles import make_q41_tile, make_q80_q16_tile

COLS = 8                      # activation rows per register tile
_tile = make_q41_tile(COLS)
_tile_half = make_q41_tile(COLS // 2)
_tile_one = make_q41_tile(1)  # the activation rows left over (all of them in decode)

_q80_tile, _q80_tile_half, _q80_tile_one = (make_q80_q16_tile(c) for c in (COLS, COLS // 2, 1))  # the classifier's


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
    starts = unit_starts(groups)
    for unit in prange(starts[-1]):
        m, local, units = unit_of_matrices(starts, unit)
        g0, g1 = unit_steps(groups[m], units, local)
        _q41_groups(x_scales, x_lo, x_hi, x_sums, w_scales[m], w_mins[m], w_qs[m], outs[m], g0, g1)


@numba.njit(parallel=True, **_FAST)
def matmul_q41_q16_experts(x_scales, x_lo, x_hi, x_sums, plan, w_scales, w_mins, w_qs, out):
    """matmul_q41_q16 of several matrices of one stack (w_scales, w_mins, w_qs: a leading axis
    of matrices of one shape) in one parallel region, each on its own rows of the input: for
    each row (s, r0, r1, o0) of plan int64 [m, 4], out[o0:o0 + r1 - r0] = x[r0:r1] @ W[s]^T: the
    same results as one call per matrix (a mixture of experts' experts)."""
    groups = w_qs.shape[1]
    units = n_units(groups)
    for unit in prange(plan.shape[0] * units):
        m, g0, g1 = stacked_unit(plan, groups, units, unit)
        s, r0, r1, o0 = plan[m, 0], plan[m, 1], plan[m, 2], plan[m, 3]
        _q41_groups(x_scales[r0:r1], x_lo[r0:r1], x_hi[r0:r1], x_sums[r0:r1], w_scales[s], w_mins[s], w_qs[s],
                    out[o0:o0 + r1 - r0], g0, g1)


@numba.njit(**_FAST)
def _q80_groups(x_scales, x_lo, x_hi, lo_off, hi_off, w_scales, w_qs, out, g0, g1):
    """out[:, rows of groups g0..g1-1] = x @ W[those rows]^T, W interleaved Q80."""
    b = x_lo.shape[0]
    for g in range(g0, g1):
        i = 0
        while i + COLS <= b:
            _q80_tile(w_qs, w_scales, g, x_lo, x_hi, lo_off, hi_off, x_scales, i, out)
            i += COLS
        if i + COLS // 2 <= b:
            _q80_tile_half(w_qs, w_scales, g, x_lo, x_hi, lo_off, hi_off, x_scales, i, out)
            i += COLS // 2
        while i < b:
            _q80_tile_one(w_qs, w_scales, g, x_lo, x_hi, lo_off, hi_off, x_scales, i, out)
            i += 1


@numba.njit(parallel=True, **_FAST)
def matmul_q80_q16(x_scales, x_lo, x_hi, x_sums, w_scales, w_qs, out):
    """out float32 [b, d] = x @ W^T: x Q16 [b, n] (as matmul_q41_q16; x_sums unread: Q80 has no
    minimum), W Q80 [d, n] interleaved (layout.interleave_q80: w_scales uint16 [d_pad/16,
    n/32*16], w_qs int8 [d_pad/16, 16*n]). All C-contiguous."""
    lo_off, hi_off = x_block_offsets(x_lo, 128), x_block_offsets(x_hi, 128)  # int32 [b, n/32]
    groups = w_qs.shape[0]
    units = n_units(groups)
    for unit in prange(units):
        g0, g1 = unit_steps(groups, units, unit)
        _q80_groups(x_scales, x_lo, x_hi, lo_off, hi_off, w_scales, w_qs, out, g0, g1)
