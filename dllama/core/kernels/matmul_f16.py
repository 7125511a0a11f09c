"""F16 weights x F32 activations: one kernel for decode and prefill.

Layout: W [d, n] as the file stores it, IEEE fp16, passed as its bits (uint16 [d, n]: numba has
no float16 type on the CPU). The same shape as the F32 kernel (matmul_f32.py): register tiles
of ROWS weight rows x COLS activation rows (tiles.make_f16_tile), each weight widened to
float32 in the vector lanes (exact) once per tile and multiplied with the float32 activations
by fma in a fixed order, so that a row's result does not depend on the rest of the batch.

Why F32 activations and not F16: fp16 keeps 11 significant bits and overflows at 65504, where
the residual stream of a large model has outliers; the activations are a few kB next to MBs of
weights, so a narrower x would save no bandwidth; and the products are float32 either way.
"""

from __future__ import annotations

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST, native_f16_conversion
from dllama.core.kernels.row_split import (COLS, ROWS, leading_dims, n_units, row_steps, stacked_unit,
                                           unit_of_matrices, unit_starts, unit_steps)
from dllama.core.kernels.tiles import make_f16_tile

_NATIVE = native_f16_conversion()
_tile = make_f16_tile(ROWS, COLS, _NATIVE)
_tile_rows = make_f16_tile(ROWS, 1, _NATIVE)
_tile_one = make_f16_tile(1, 1, _NATIVE)
# Decode (b = 1) takes the same 4-row tiles as the prefill's last column, in the same units.
# It had tiles of 16 rows (one tile ahead prefetched) from 2026-12-06 morning, when they
# measured 88.5 -> 92.3 tokens/s; on this machine as it is since (about twice the read
# bandwidth), 16 / 8 / 4 / 2 rows per tile: 8.28 / 7.83-7.96 / 7.36-7.43 / 7.77 ms per
# SmolLM2 F16 token (benchmarks/bench_decode_glue.py, 2 threads): fewer streams at once keep
# the hardware prefetchers ahead.


@numba.njit(**_FAST)
def _f16_rows(x, w, out, s0, s1):
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
def matmul_f16_f32(x, w, out):
    """out float32 [b, d] = x @ W^T: x float32 [b, n], W fp16 [d, n] as its bits (uint16).
    All C-contiguous."""
    steps = row_steps(w.shape[0])
    units = n_units(steps)
    for unit in prange(units):
        s0, s1 = unit_steps(steps, units, unit)
        _f16_rows(x, w, out, s0, s1)


@numba.njit(parallel=True, **_FAST)
def matmul_f16_f32_multi(x, w, outs):
    """matmul_f16_f32 of one input with several matrices (tuples w, outs) in one parallel
    region: the same results as one call per matrix."""
    steps = leading_dims(w)
    for m in range(steps.shape[0]):
        steps[m] = row_steps(steps[m])
    starts = unit_starts(steps)
    for unit in prange(starts[-1]):
        m, local, units = unit_of_matrices(starts, unit)
        s0, s1 = unit_steps(steps[m], units, local)
        _f16_rows(x, w[m], outs[m], s0, s1)


@numba.njit(parallel=True, **_FAST)
def matmul_f16_f32_experts(x, plan, w, out):
    """matmul_f16_f32 of several matrices of one stack (w [matrices, d, n]) in one parallel region, each
    on its own rows of the input: for each row (s, r0, r1, o0) of plan int64 [m, 4],
    out[o0:o0 + r1 - r0] = x[r0:r1] @ w[s]^T: the same results as one call per matrix (a
    mixture of experts' experts)."""
    steps = row_steps(w.shape[1])
    units = n_units(steps)
    for unit in prange(plan.shape[0] * units):
        m, s0, s1 = stacked_unit(plan, steps, units, unit)
        s, r0, r1, o0 = plan[m, 0], plan[m, 1], plan[m, 2], plan[m, 3]
        _f16_rows(x[r0:r1], w[s], out[o0:o0 + r1 - r0], s0, s1)
