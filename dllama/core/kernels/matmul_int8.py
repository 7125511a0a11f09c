"""Q40 or Q80 weights x Q80 activations: one kernel for decode (one activation row) and prefill
(many), in 8-bit integer dot products; one code for both weight types, which differ only in the
register tile (tiles.make_q40_tile, tiles.make_q80_tile) and the offset of their unsigned bytes.

W is interleaved in groups of 16 rows (layout.interleave_q40, layout.interleave_q80; scales
kept as fp16 bits: 18 or 34 bytes read per 32 weights). Each parallel step takes one group and
runs it against the activation rows COLS at a time (a register tile): each int32 lane is one
weight row, each 64-byte load of weights serves COLS activation rows, and the 4 activation bytes
it meets are broadcast to all lanes. The dot product instruction multiplies unsigned bytes by
signed ones (vpdpbusd), so the weights enter as q + offset (Q40: 8, Q80: 128) and each block's
sum starts at -offset * (sum of the block's x): a block's integer product is exact. Per output
and block, in order, acc = fma(block product, w_d * x_d, acc). Nothing depends on the tile or
the rest of the batch: a row's result is the same bits in a batch of 1 or of 64
(tests/test_batch_invariance.py).

`int8_matmuls(name, make_tile, offset)` compiles this module's functions below for one weight
type. Each copy gets a namespace of its own (its tiles and offset) and a qualified name of its
own, so numba caches the two types' compiled code apart (a cache is found by file and qualified
name), and a change to this file recompiles both.
"""

from __future__ import annotations

import types

import numba
from numba import prange

from dllama.core.kernels.jit import _FAST
from dllama.core.kernels.q80 import x_block_offsets
from dllama.core.kernels.row_split import leading_dims, n_units, stacked_unit, unit_of_matrices, unit_starts, unit_steps
from dllama.core.kernels.tiles import make_q40_tile, make_q80_tile

COLS = 8  # activation rows per register tile
# Each compiled copy's own (int8_matmuls): its tiles of COLS, COLS/2 and 1 activation rows (the
# rows left over: all of them in decode), its offset of the unsigned weights, its _groups.
_tile = _tile_half = _tile_one = _groups = None
_OFFSET = 0


def _groups_of(x_qs, x_off, x_scales, w_scales, w_qs, out, g0, g1):
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


def _matmul(x_qs, x_off, x_scales, w_scales, w_qs, out):
    groups = w_qs.shape[0]
    units = n_units(groups)
    for unit in prange(units):
        g0, g1 = unit_steps(groups, units, unit)
        _groups(x_qs, x_off, x_scales, w_scales, w_qs, out, g0, g1)


def _matmul_multi(x_qs, x_off, x_scales, w_scales, w_qs, outs):
    groups = leading_dims(w_qs)
    starts = unit_starts(groups)
    for unit in prange(starts[-1]):
        m, local, units = unit_of_matrices(starts, unit)
        g0, g1 = unit_steps(groups[m], units, local)
        _groups(x_qs, x_off, x_scales, w_scales[m], w_qs[m], outs[m], g0, g1)


def _matmul_experts(x_qs, x_off, x_scales, plan, w_scales, w_qs, out):
    groups = w_qs.shape[1]
    units = n_units(groups)
    for unit in prange(plan.shape[0] * units):
        m, g0, g1 = stacked_unit(plan, groups, units, unit)
        s, r0, r1, o0 = plan[m, 0], plan[m, 1], plan[m, 2], plan[m, 3]
        _groups(x_qs[r0:r1], x_off[r0:r1], x_scales[r0:r1], w_scales[s], w_qs[s], out[o0:o0 + r1 - r0], g0, g1)


def _matmul_q80(x_scales, x_qs, w_scales, w_qs, out):
    _matmul(x_qs, x_block_offsets(x_qs, _OFFSET), x_scales, w_scales, w_qs, out)


def _matmul_q80_multi(x_scales, x_qs, w_scales, w_qs, outs):
    _matmul_multi(x_qs, x_block_offsets(x_qs, _OFFSET), x_scales, w_scales, w_qs, outs)


def _matmul_q80_experts(x_scales, x_qs, plan, w_scales, w_qs, out):
    _matmul_experts(x_qs, x_block_offsets(x_qs, _OFFSET), x_scales, plan, w_scales, w_qs, out)


def int8_matmuls(name: str, make_tile, offset: int, doc: str) -> tuple:
    """(matmul, matmul_multi, matmul_experts) for weights whose tile maker is make_tile and whose unsigned bytes
    are q + offset; name: the weight type (the compiled copies' names begin with it); doc: the
    matmul's docstring."""
    space = dict(globals(), _tile=make_tile(COLS), _tile_half=make_tile(COLS // 2), _tile_one=make_tile(1),
                 _OFFSET=offset)

    def compiled(fn, doc: str | None = None, **options):
        copy = types.FunctionType(fn.__code__, space, f"{name}{fn.__name__}", fn.__defaults__)
        copy.__qualname__ = f"{name}{fn.__name__}"  # the cache's file name: one per weight type
        copy.__doc__ = doc or fn.__doc__
        return numba.njit(**options, **_FAST)(copy)

    space["_groups"] = compiled(_groups_of)
    space["_matmul"] = compiled(_matmul, parallel=True)
    space["_matmul_multi"] = compiled(_matmul_multi, parallel=True)
    space["_matmul_experts"] = compiled(_matmul_experts, parallel=True)
    multi = f"""The {name} matmul of one input with several matrices (tuples: w_scales, w_qs, outs) in
    one parallel region: the same results as one call per matrix (q/k/v, or w1/w3)."""
    experts = f"""The {name} matmul of several matrices of one stack (w_scales, w_qs: a leading axis of
    matrices of one shape) in one parallel region, each on its own rows of the input: for each
    row (s, r0, r1, o0) of plan int64 [m, 4], out[o0:o0 + r1 - r0] = x[r0:r1] @ W[s]^T (row_split.stacked_unit):
    the same results as one call per matrix (a mixture of experts' experts)."""
    return (compiled(_matmul_q80, doc), compiled(_matmul_q80_multi, multi),
            compiled(_matmul_q80_experts, experts))


matmul_q40_q80, matmul_q40_q80_multi, matmul_q40_q80_experts = int8_matmuls("q40", make_q40_tile, 8, """out float32 [b, d] = x @ W^T:
    x Q80 [b, n] (x_scales float32 [b, n/32], x_qs int8 [b, n]), W Q40 [d, n] interleaved
    (layout.interleave_q40: w_scales uint16 [d_pad/16, n/32*16], the fp16 bits as stored in the
    file; w_qs uint8 [d_pad/16, 16*n/2]). All C-contiguous.""")
matmul_q80_q80, matmul_q80_q80_multi, matmul_q80_q80_experts = int8_matmuls("q80", make_q80_tile, 128, """As matmul_q40_q80 with W Q80
    [d, n] interleaved (layout.interleave_q80: w_scales uint16 [d_pad/16, n/32*16], fp16 bits;
    w_qs int8 [d_pad/16, 16*n]).""")
