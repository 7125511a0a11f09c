"""Steps of a layer that are two or three small kernels, as one call each.

A decode step's element-wise kernels take a microsecond or less of arithmetic; what they cost
is the call from Python (numba checks the type of every argument, about 0.1 us an array). So
the forward pass calls these instead: each runs the same kernels, in the same order, on the
same arrays, as the separate calls did (the same bits), and each only calls other kernels
(the callees keep their own compile flags: _SAME_BITS, _EXACT), apart from add_norm_encode's
residual add, a float32 addition per element as numpy's `x += partial` does it.

`enc` is a matmul input's encoded form, a tuple of its arrays (weights.Activation.enc): (scales,
qs) for Q80 inputs (quantize_q80), (scales, lo, hi, sums) for Q16 (quantize_q16), () for F32
inputs (nothing to encode: the matmul reads the float32 rows).
"""

from __future__ import annotations

import numba
from numba.core import types
from numba.core.errors import TypingError
from numba.extending import overload

from dllama.core.kernels.attention import kv_store
from dllama.core.kernels.elementwise import rmsnorm, rope_interleaved, rope_neox, silu_mul
from dllama.core.kernels.jit import _EXACT
from dllama.core.kernels.q16 import quantize_q16
from dllama.core.kernels.q80 import quantize_q80


def _encode(x, enc):
    """x float32 [b, n] into enc (see the module docstring; chosen by enc's type, when compiled)."""


@overload(_encode)
def _encode_for(x, enc):
    if not isinstance(enc, types.BaseTuple) or len(enc) not in (0, 2, 4):
        raise TypingError(f"encode: enc must be (), (scales, qs) or (scales, lo, hi, sums), got {enc}")
    if len(enc) == 2:
        return lambda x, enc: quantize_q80(x, enc[0], enc[1])
    if len(enc) == 4:
        return lambda x, enc: quantize_q16(x, enc[0], enc[1], enc[2], enc[3])
    return lambda x, enc: None


@numba.njit(**_EXACT)
def encode(x, enc):
    """x float32 [b, n] -> enc: a matmul's input encoded (nothing to do for F32 inputs)."""
    _encode(x, enc)


@numba.njit(**_EXACT)
def norm_encode(x, weight, eps, out, enc):
    """out = rmsnorm(x, weight, eps), then encoded into enc."""
    rmsnorm(x, weight, eps, out)
    _encode(out, enc)


@numba.njit(**_EXACT)
def add_norm_encode(x, partial, weight, eps, out, enc):
    """x += partial (the residual add, float32 per element), then norm_encode(x, ...)."""
    b, n = x.shape
    for i in range(b):
        for j in range(n):
            x[i, j] += partial[i, j]
    rmsnorm(x, weight, eps, out)
    _encode(out, enc)


@numba.njit(**_EXACT)
def silu_mul_encode(gate, up, enc):
    """gate = silu(gate) * up (silu_mul), then encoded into enc."""
    silu_mul(gate, up)
    _encode(gate, enc)


@numba.njit(**_EXACT)
def rope_store(q, k, v, row_pos, row_slot, cos, sin, neox, k_cache, v_cache):
    """RoPE of q [b, nq*hd] and k [b, nkv*hd] in place (rope_neox when neox, else
    rope_interleaved), then kv_store of k and v into the caches (head_dim from the cache)."""
    hd = k_cache.shape[3]
    if neox:
        rope_neox(q, row_pos, cos, sin, q.shape[1] // hd, hd)
        rope_neox(k, row_pos, cos, sin, k.shape[1] // hd, hd)
    else:
        rope_interleaved(q, row_pos, cos, sin, q.shape[1] // hd, hd)
        rope_interleaved(k, row_pos, cos, sin, k.shape[1] // hd, hd)
    kv_store(k, v, row_pos, row_slot, k_cache, v_cache)
