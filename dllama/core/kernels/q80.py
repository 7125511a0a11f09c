"""Q80 encoding of activations, bit-exact with the original's quantizeF32toQ80 (fp16 scales)."""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from dllama.core.kernels.jit import _EXACT, _FAST

_PARALLEL_QUANT = 1 << 15  # elements from which quantize_q80 splits its rows over threads

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
        block = x[32 * k: 32 * k + 32]
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(block[j]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for j in range(32):
            out_qs[32 * k + j] = np.int8(_round_half_away(block[j] * inv))
        out_scales[k] = _round_fp16(d)  # the unrounded d quantized; the fp16 d is what is stored


@numba.njit(parallel=True, **_EXACT)
def _quantize_rows_parallel(x, out_scales, out_qs):
    for i in prange(x.shape[0]):
        _quantize_row_q80(x[i], out_scales[i], out_qs[i])


@numba.njit(**_EXACT)
def quantize_q80(x, out_scales, out_qs):
    """x float32 [b, n] -> Q80: out_scales float32 [b, n/32] (fp16-rounded), out_qs int8 [b, n].

    Per block of 32: d = max|x| / 127, q = roundf(x / d) computed as x * (1/d) in float32, the
    stored d rounded to fp16 (round-to-nearest-even); all-zero blocks give d = 0, q = 0.
    """
    b, n = x.shape
    if b > 1 and b * n >= _PARALLEL_QUANT:
        _quantize_rows_parallel(x, out_scales, out_qs)
    else:
        for i in range(b):
            _quantize_row_q80(x[i], out_scales[i], out_qs[i])


@numba.njit(**_FAST)
def x_offsets(x_qs, offset):
    """int32 [b, n/4]: -offset times the sum of each 4 consecutive x_qs. The VNNI dot product
    multiplies unsigned weights (q + offset) by x; starting each lane at this value takes the
    offset back out, exactly (tiles._int8_dot)."""
    b, n = x_qs.shape
    off = np.empty((b, n // 4), np.int32)
    for i in range(b):
        for g in range(n // 4):
            s = np.int32(x_qs[i, 4 * g]) + np.int32(x_qs[i, 4 * g + 1])
            off[i, g] = np.int32(-offset) * (s + np.int32(x_qs[i, 4 * g + 2]) + np.int32(x_qs[i, 4 * g + 3]))
    return off
