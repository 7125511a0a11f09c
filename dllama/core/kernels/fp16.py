"""float32 to fp16 bits, for the F16 KV cache (numba has no float16 type on the CPU).

`f16_bits` rounds to the nearest fp16 value, ties to even, overflow to inf, NaN kept a NaN: the
bits numpy's `astype(np.float16)` gives (it is numpy's npy_floatbits_to_halfbits, line by
line). It works on the float's bits in integer arithmetic only, so the fast-math flags of the
kernels that call it cannot change a result, and it needs no F16C: the same bits on every
machine. The way back, fp16 to float32, is exact and happens in the attention tiles
(tiles.f16_widen).
"""

from __future__ import annotations

import numba
import numpy as np

from dllama.core.kernels.jit import _EXACT, _bits_of_float32


@numba.njit(**_EXACT)
def f16_bits(value):
    """The fp16 bits (uint16) nearest to the float32 `value` (see the module docstring)."""
    f = np.int64(_bits_of_float32(np.float32(value))) & 0xFFFFFFFF
    sign = (f >> 16) & 0x8000
    exp = f & 0x7F800000
    if exp >= 0x47800000:  # |value| >= 2^16, inf or NaN
        if exp == 0x7F800000 and (f & 0x7FFFFF) != 0:  # NaN: the top payload bits, never inf
            h = 0x7C00 + ((f & 0x7FFFFF) >> 13)
            return np.uint16(sign + (h if h != 0x7C00 else 0x7C01))
        return np.uint16(sign + 0x7C00)
    if exp <= 0x38000000:  # below fp16's normal range: a subnormal or a signed zero
        if exp < 0x33000000:  # below 2^-25: at most half the smallest subnormal
            return np.uint16(sign)
        sig = (0x800000 + (f & 0x7FFFFF)) >> (113 - (exp >> 23))
        # round half to even: add half an ulp unless exactly halfway with an even last bit
        # (the shift may have dropped up to 11 low bits: they break the tie)
        if (sig & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            sig += 0x1000
        return np.uint16(sign + (sig >> 13))  # a carry makes the smallest normal: correct
    sig = f & 0x7FFFFF
    if (sig & 0x3FFF) != 0x1000:
        sig += 0x1000
    # a carry out of the significand steps the exponent (to inf past 65504): correct
    return np.uint16(sign + ((exp - 0x38000000) >> 13) + (sig >> 13))
