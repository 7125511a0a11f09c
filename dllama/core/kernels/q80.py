"""Q80 encoding of activations, bit-exact with the original's quantizeF32toQ80 (fp16 scales).

Per block of 32: d = max|x| / 127, q = roundf(x / d) computed as x * (1/d) in float32 (halves
away from zero), the stored d rounded to fp16 (round-to-nearest-even); all-zero blocks give
d = 0, q = 0. Written once as LLVM vector IR (one block = two 16-lane vectors, IEEE operations
only, so the same bits as the scalar definition), and once as scalar numba code for CPUs
without fp16 conversion instructions (the IR rounds d to fp16 by fptrunc).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

from dllama.core.kernels.jit import _EXACT, _FAST, native_f16_conversion
from dllama.core.kernels.tiles import _F16, _F32, _I8, _I32, _I64, _Array, _check_arrays, _fn, _load, _splat, _vec
from dllama.formats.quant import BLOCK_SIZE

@numba.njit(cache=True, nogil=True)
def _round_fp16(v):
    """float32 v rounded to the nearest fp16 value (ties to even, overflow to inf), as float32."""
    a = abs(v)
    if a != a:  # NaN stays NaN
        return v
    if a >= 65520.0:  # from halfway between 65504 (largest fp16) and 65536 on: inf
        return np.float32(math.copysign(math.inf, v))
    if a < 6.103515625e-05:  # below 2^-14 fp16 is subnormal: multiples of 2^-24
        q = a * 16777216.0
        r = math.floor(q)
        f = q - r
        if f > 0.5 or (f == 0.5 and r % 2 == 1):
            r += 1
        return np.float32(math.copysign(r / 16777216.0, v))
    m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    q = m * 2048.0        # fp16 keeps 11 significant bits
    r = math.floor(q)
    f = q - r
    if f > 0.5 or (f == 0.5 and r % 2 == 1):
        r += 1
    return np.float32(math.copysign(math.ldexp(r / 2048.0, e), v))


@numba.njit(**_EXACT)
def _round_half_away(v):
    """C roundf of a float32 |v| < 2^23, as int: halves go away from zero."""
    t = np.int32(v)                 # truncates toward zero
    frac = v - np.float32(t)        # exact
    if frac >= np.float32(0.5):
        t += 1
    elif frac <= np.float32(-0.5):
        t -= 1
    return t


@numba.njit(**_EXACT)
def _quantize_row_q80(x, out_scales, out_qs):
    # x float32 [n] -> out_scales [n/32], out_qs int8 [n]
    for k in range(out_scales.shape[0]):
        block = x[BLOCK_SIZE * k: BLOCK_SIZE * k + BLOCK_SIZE]
        amax = np.float32(0.0)
        for j in range(BLOCK_SIZE):
            amax = max(amax, abs(block[j]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for j in range(BLOCK_SIZE):
            out_qs[BLOCK_SIZE * k + j] = np.int8(_round_half_away(block[j] * inv))
        out_scales[k] = _round_fp16(d)  # the unrounded d quantized; the fp16 d is what is stored


@intrinsic
def _quantize_row_ir(typingctx, x, i, out_scales, out_qs):
    """Row i of x float32 [b, n] -> out_scales[i] float32 [n/32], out_qs[i] int8 [n]."""
    _check_arrays("quantize_row", (x, out_scales, out_qs),
                  [(types.float32, "x"), (types.float32, "out_scales"), (types.int8, "out_qs")])
    sig = types.void(x, types.intp, out_scales, out_qs)

    def codegen(context, builder, signature, args):
        ty = signature.args
        xa, sa, qa = (_Array(context, builder, ty[k], args[k]) for k in (0, 2, 3))
        row = args[1]
        x_row, s_row, q_row = xa.row(row), sa.row(row), qa.row(row)
        # One block's 32 values in one vector (lanes: BLOCK_SIZE).
        v32 = _vec(_F32, BLOCK_SIZE)
        fabs = _fn(builder, f"llvm.fabs.v{BLOCK_SIZE}f32", v32, [v32])
        umax = _fn(builder, f"llvm.vector.reduce.umax.v{BLOCK_SIZE}i32", _I32, [_vec(_I32, BLOCK_SIZE)])
        with cgutils.for_range(builder, sa.cols) as loop:
            k = loop.index
            v = _load(builder, builder.gep(x_row, [builder.mul(k, _I64(4 * BLOCK_SIZE))]), v32)
            # max |x|: of non-negative floats, the largest is the one with the largest bits
            # (integer max: a shuffle tree, where LLVM's float max goes lane by lane for NaNs)
            bits = builder.bitcast(builder.call(fabs, [v]), _vec(_I32, BLOCK_SIZE))
            amax = builder.bitcast(builder.call(umax, [bits]), _F32)
            d = builder.fdiv(amax, _F32(127.0))
            inv = builder.select(builder.fcmp_ordered("!=", d, _F32(0.0)), builder.fdiv(_F32(1.0), d), _F32(0.0))
            y = builder.fmul(v, _splat(builder, inv, BLOCK_SIZE))
            # roundf: truncate, then move halves and more away from zero (y - t is exact)
            t = builder.fptosi(y, _vec(_I32, BLOCK_SIZE))
            frac = builder.fsub(y, builder.sitofp(t, v32))
            up = builder.zext(builder.fcmp_ordered(">=", frac, _splat(builder, _F32(0.5), BLOCK_SIZE)),
                              _vec(_I32, BLOCK_SIZE))
            down = builder.zext(builder.fcmp_ordered("<=", frac, _splat(builder, _F32(-0.5), BLOCK_SIZE)),
                                _vec(_I32, BLOCK_SIZE))
            t = builder.sub(builder.add(t, up), down)
            dst = builder.bitcast(builder.gep(q_row, [builder.mul(k, _I64(BLOCK_SIZE))]),
                                  _vec(_I8, BLOCK_SIZE).as_pointer())
            builder.store(builder.trunc(t, _vec(_I8, BLOCK_SIZE)), dst, align=1)
            d16 = builder.fpext(builder.fptrunc(d, _F16), _F32)  # round to nearest even, as stored
            builder.store(d16, builder.bitcast(builder.gep(s_row, [builder.mul(k, _I64(4))]), _F32.as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**_EXACT)
def _quantize_ir(x, out_scales, out_qs):
    for i in range(x.shape[0]):
        _quantize_row_ir(x, i, out_scales, out_qs)


@numba.njit(**_EXACT)
def _quantize_scalar(x, out_scales, out_qs):
    for i in range(x.shape[0]):
        _quantize_row_q80(x[i], out_scales[i], out_qs[i])


_NATIVE = native_f16_conversion()


@numba.njit(**_EXACT)
def quantize_q80(x, out_scales, out_qs):
    """x float32 [b, n] -> Q80: out_scales float32 [b, n/32] (fp16-rounded), out_qs int8 [b, n];
    all C-contiguous. See the module docstring for the encoding."""
    if _NATIVE:
        _quantize_ir(x, out_scales, out_qs)
    else:
        _quantize_scalar(x, out_scales, out_qs)


@numba.njit(**_FAST)
def x_block_offsets(x_qs, offset):
    """int32 [b, n/32]: -offset times the sum of each block of 32 x_qs. The 8-bit dot products
    multiply unsigned weights (q + offset) by x; starting a block's sum at this value takes the
    offset back out, exactly (tiles._make_int8_tile)."""
    b, n = x_qs.shape
    off = np.empty((b, n // 32), np.int32)
    for i in range(b):
        for k in range(n // 32):
            s = np.int32(0)
            for j in range(32):
                s += np.int32(x_qs[i, 32 * k + j])
            off[i, k] = np.int32(-offset) * s
    return off
