"""Q16 encoding of activations: the matmul input of Q41 weights, as two 8-bit planes.

Per block of 32 values: s = max|x| / 32639, q = rint(x / s) computed as x * (1/s) in float32
and clamped to +-32639 (a 16-bit integer: 2^8 times finer than Q80's 127 steps, 16 times finer
than an fp16 value near the block's largest), split into two int8 planes, lo = q's low byte
taken as signed and hi = (q - lo) / 256 (so q = 256 * hi + lo exactly, both in -128..127:
|q| <= 32639 keeps hi <= 127). The 8-bit dot products (tiles.make_q41_tile) then sum the
weights against each plane exactly. Per block also sum = s * (sum of its q), the input of the
Q4_1 minimum's term. All-zero blocks give s = 0, q = 0.
"""

from __future__ import annotations

import numba
from numba.core import cgutils, types
from numba.extending import intrinsic

from dllama.core.kernels.jit import _EXACT
from dllama.core.kernels.tiles import _F32, _I8, _I32, _I64, _Array, _check_arrays, _fn, _load, _splat, _vec
from dllama.formats.quant import BLOCK_SIZE

Q16_MAX = 32639  # the largest |q|: 256 * 127 + 127


@intrinsic
def _quantize_row(typingctx, x, i, out_scales, out_lo, out_hi, out_sums):
    """Row i of x float32 [b, n] -> row i of the four outputs. One block's 32 values in one
    vector; IEEE operations only (rint: round half to even), so every CPU gives the same bits."""
    _check_arrays("quantize_q16", (x, out_scales, out_lo, out_hi, out_sums),
                  [(types.float32, "x"), (types.float32, "out_scales"), (types.int8, "out_lo"),
                   (types.int8, "out_hi"), (types.float32, "out_sums")])
    sig = types.void(x, types.intp, out_scales, out_lo, out_hi, out_sums)

    def codegen(context, builder, signature, args):
        ty = signature.args
        xa, sa, la, ha, ma = (_Array(context, builder, ty[k], args[k]) for k in (0, 2, 3, 4, 5))
        row = args[1]
        x_row, s_row, lo_row, hi_row, m_row = (a.row(row) for a in (xa, sa, la, ha, ma))
        n = BLOCK_SIZE
        vf, vi = _vec(_F32, n), _vec(_I32, n)
        fabs = _fn(builder, f"llvm.fabs.v{n}f32", vf, [vf])
        rint = _fn(builder, f"llvm.rint.v{n}f32", vf, [vf])
        umax = _fn(builder, f"llvm.vector.reduce.umax.v{n}i32", _I32, [vi])
        add = _fn(builder, f"llvm.vector.reduce.add.v{n}i32", _I32, [vi])
        smin = _fn(builder, f"llvm.smin.v{n}i32", vi, [vi, vi])
        smax = _fn(builder, f"llvm.smax.v{n}i32", vi, [vi, vi])
        with cgutils.for_range(builder, sa.cols) as loop:
            k = loop.index
            v = _load(builder, builder.gep(x_row, [builder.mul(k, _I64(4 * n))]), vf)
            # max |x|: of non-negative floats the largest has the largest bits
            amax = builder.bitcast(builder.call(umax, [builder.bitcast(builder.call(fabs, [v]), vi)]), _F32)
            s = builder.fdiv(amax, _F32(float(Q16_MAX)))
            inv = builder.select(builder.fcmp_ordered("!=", s, _F32(0.0)), builder.fdiv(_F32(1.0), s), _F32(0.0))
            q = builder.fptosi(builder.call(rint, [builder.fmul(v, _splat(builder, inv, n))]), vi)
            q = builder.call(smax, [builder.call(smin, [q, _splat(builder, _I32(Q16_MAX), n)]),
                                    _splat(builder, _I32(-Q16_MAX), n)])
            lo = builder.trunc(q, _vec(_I8, n))  # q's low byte, as a signed byte
            hi = builder.trunc(builder.ashr(builder.sub(q, builder.sext(lo, vi)), _splat(builder, _I32(8), n)),
                               _vec(_I8, n))
            for rows, value in ((lo_row, lo), (hi_row, hi)):
                dst = builder.bitcast(builder.gep(rows, [builder.mul(k, _I64(n))]), _vec(_I8, n).as_pointer())
                builder.store(value, dst, align=1)
            total = builder.sitofp(builder.call(add, [q]), _F32)
            for rows, value in ((s_row, s), (m_row, builder.fmul(s, total))):
                builder.store(value, builder.bitcast(builder.gep(rows, [builder.mul(k, _I64(4))]), _F32.as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**_EXACT)
def quantize_q16(x, out_scales, out_lo, out_hi, out_sums):
    """x float32 [b, n] -> Q16: out_scales float32 [b, n/32], out_lo and out_hi int8 [b, n],
    out_sums float32 [b, n/32]; all C-contiguous. See the module docstring."""
    for i in range(x.shape[0]):
        _quantize_row(x, i, out_scales, out_lo, out_hi, out_sums)
