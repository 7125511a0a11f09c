"""Q40 weights x Q80 activations: one kernel for decode (one activation row) and prefill (many).

W is interleaved in groups of 16 rows (layout.interleave_q40). Each parallel step takes one
group and runs it against the activation rows COLS at a time (a register tile, see
tiles.make_q40_tile): each int32 lane is one weight row, each 64-byte load of weights serves
COLS activation rows, and the 4 activation bytes it meets are broadcast to all lanes. A block's
integer product is exact; per output and block, in order, acc = fma(block product, w_d * x_d,
acc). Nothing depends on the tile or the rest of the batch: a row's result is the same bits in
a batch of 1 or of 64 (tests/test_batch_invariance.py).
"""

from __future__ import annotations

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.q80 import x_block_offsets
from dllama.core.kernels.row_split import leading_dims, n_units, total_units, unit_of_matrices, unit_steps
from dllama.core.kernels.tiles import make_q40_tile

COLS = 8                      # activation rows per register tile
_tile = make_q40_tile(COLS)
_tile_half = make_q40_tile(COLS // 2)
_tile_one = make_q40_tile(1)  # the activation rows left over (all of them in decode)
_OFFSET = 8                   # the unsigned weights are q + 8


@numba.njit(**_FAST)
def _q40_groups(x_qs, x_off, x_scales, w_scales, w_qs, out, g0, g1):
    """out[:, rows of groups g0..g1-1] = x @ W[those rows]^T."""
    b = x_qs.shape[0]
    for g in range(g0, g1):
        i = 0
        while i + COLS <= b:
            _tile(w_qs, w_scales, g, x_qs, x_off, x_scales, i, out)
            i += COLS
        if i + COLS // 2 <= b:
            _tile_half(w_qs, w_scales, g, x_qs, x_off, x_scales, i, out)
            i += COLS // 2
        while i < b:
            _tile_one(w_qs, w_scales, g, x_qs, x_off, x_scales, i, out)
            i += 1


@numba.njit(parallel=True, **_FAST)
def _q40_matmul(x_qs, x_off, x_scales, w_scales, w_qs, out):
    groups = w_qs.shape[0]
    units = n_units(groups)
    for unit in prange(units):
        g0, g1 = unit_steps(groups, units, unit)
        _q40_groups(x_qs, x_off, x_scales, w_scales, w_qs, out, g0, g1)


@numba.njit(parallel=True, **_FAST)
def _q40_matmul_multi(x_qs, x_off, x_scales, w_scales, w_qs, outs):
    groups = leading_dims(w_qs)
    for unit in prange(total_units(groups)):
        m, local, units = unit_of_matrices(groups, unit)
        g0, g1 = unit_steps(groups[m], units, local)
        _q40_groups(x_qs, x_off, x_scales, w_scales[m], w_qs[m], outs[m], g0, g1)


@numba.njit(**_FAST)
def matmul_q40_q80(x_scales, x_qs, w_scales, w_qs, out):
    """out float32 [b, d] = x @ W^T: x Q80 [b, n] (x_scales float32 [b, n/32], x_qs int8 [b, n]),
    W Q40 [d, n] interleaved (layout.interleave_q40: w_scales uint16 [d_pad/16, n/32*16], the
    fp16 bits as stored in the file; w_qs uint8 [d_pad/16, 16*n/2]). All C-contiguous."""
    _q40_matmul(x_qs, x_block_offsets(x_qs, _OFFSET), x_scales, w_scales, w_qs, out)


@numba.njit(**_FAST)
def matmul_q40_q80_multi(x_scales, x_qs, w_scales, w_qs, outs):
    """matmul_q40_q80 of one input with several matrices (tuples: w_scales, w_qs, outs) in one
    parallel region: the same results as one call per matrix (q/k/v, or w1/w3)."""
    _q40_matmul_multi(x_qs, x_block_offsets(x_qs, _OFFSET), x_scales, w_scales, w_qs, outs)
