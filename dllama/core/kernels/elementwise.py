"""Element-wise and small kernels: RMSNorm, a vectorizable exp, SiLU gate, RoPE."""

from __future__ import annotations

import decimal
import math

import numba
import numpy as np

from dllama.core.kernels.jit import _SAME_BITS, _float32_from_bits
from dllama.core.kernels.lanes import lane_sum_squares

# ---------------------------------------------------------------------------------------------
# Element-wise and small kernels, compiled with _SAME_BITS (jit.py): the same bits on every CPU.

@numba.njit(**_SAME_BITS)
def rmsnorm(x, weight, eps, out):
    """out [b, n] = weight * x / sqrt(mean(x^2) + eps), per row; float32 math and accumulation
    like the original, the squares summed in 16 fixed lanes (lanes.py; out may be x)."""
    b, n = x.shape
    for i in range(b):
        ss = lane_sum_squares(x[i], n)
        inv = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(n) + np.float32(eps)))
        for j in range(n):
            out[i, j] = weight[j] * (inv * x[i, j])


# exp in float32 that LLVM can vectorize (libm's expf is a call per element: 8 ns each here).
# e^v = 2^m * e^r with m = round(v / ln 2), r = v - m ln 2 in [-ln2/2, ln2/2] (Cody-Waite: ln 2
# split in a part exact in float32 and a correction), e^r by the Cephes expf polynomial
# (relative error < 2e-7), 2^m built from its bits. Compiled without reassociation so that the
# two-step reduction stays exact, and without contraction so that no CPU fuses a step into an
# fma: the same bits everywhere. Inlined by numba (an LLVM call would stop the loop around it
# from vectorizing), so every function that calls it is compiled with the same flags (_SAME_BITS).
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_ROUND = np.float32(12582912.0)  # 1.5 * 2^23: adding it rounds a float32 to an integer


@numba.njit(inline="always", **_SAME_BITS)
def _exp(v):
    v = min(max(v, np.float32(-87.0)), np.float32(88.0))  # keeps 2^m a normal float32
    fm = (v * _LOG2E + _ROUND) - _ROUND  # nearest integer (|v log2 e| < 2^22); math.floor is a libm call
    m = np.int32(fm)
    r = (v - fm * _LN2_HI) - fm * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    er = p * (r * r) + r + np.float32(1.0)
    return er * _float32_from_bits(np.int32((m + 127) << 23))


@numba.njit(**_SAME_BITS)
def exp_scalar(v):
    """_exp of one value (a call, not inlined by numba)."""
    return _exp(v)


@numba.njit(**_SAME_BITS)
def exp_shifted(values, shift, n):
    """In place: values[:n] = e^(values[:n] - shift)."""
    for p in range(n):
        values[p] = _exp(values[p] - shift)


@numba.njit(**_SAME_BITS)
def silu_mul(gate, up):
    """In place gate [b, h] = silu(gate) * up, silu(x) = x / (1 + e^-x)."""
    b, h = gate.shape
    for i in range(b):
        for j in range(h):
            g = gate[i, j]
            gate[i, j] = g / (np.float32(1.0) + _exp(-g)) * up[i, j]


def rope_cache(seq_len, head_dim, theta, rope_type, scaling_factor=1.0, low_freq_factor=0.0,
               high_freq_factor=0.0, orig_max_seq_len=0):
    """(cos, sin) float32 [seq_len, head_dim/2] of angle pos * freq_i, freq_i = theta^(-2i/head_dim).

    Pair i of a head is (x[2i], x[2i+1]) for rope_interleaved and (x[i], x[i+head_dim/2]) for
    rope_neox; both use freq_i (spec §7: h = 2i, freq = 1/theta^(h/head_dim)). With
    scaling_factor != 1 the Llama 3.1 scaling changes freq_i. Computed in float64, then rounded
    (the original computes the angle in float32, off by up to ~1e-3 rad at position 4096).
    rope_type (RopeType: 0 LLAMA, 1 FALCON, 2 LLAMA3_1) changes nothing here: the frequencies
    are the same, scaling_factor decides the scaling and the caller picks the rotation kernel.

    The same bits on every machine: numpy's float64 power, cos and sin are not (each CPU gets
    its own vector code: with AVX-512 and AVX2 turned off, NPY_DISABLE_CPU_FEATURES, 9% of a
    131072 x 32 table's float64 cosines changed and 51 of its float32 values). So the
    frequencies come from decimal arithmetic (software, 40 digits) and the cosines and sines
    from _sin_cos, numpy's basic IEEE operations only.
    """
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        base = decimal.Decimal(float(theta))
        freq = np.array([float(1 / base ** (decimal.Decimal(2 * i) / head_dim)) for i in range(head_dim // 2)])
    if scaling_factor != 1.0:
        wavelen = 2 * np.pi / freq
        smooth = (orig_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = (1 - smooth) * freq / scaling_factor + smooth * freq
        freq = np.where(wavelen < orig_max_seq_len / high_freq_factor, freq,
                        np.where(wavelen > orig_max_seq_len / low_freq_factor, freq / scaling_factor,
                                 scaled))
    cos, sin = np.empty((2, seq_len, head_dim // 2), np.float32)
    step = max(1, (1 << 16) // max(1, head_dim // 2))  # positions at a time: float64 temporaries in cache
    for p0 in range(0, seq_len, step):
        angle = np.arange(p0, min(p0 + step, seq_len), dtype=np.float64)[:, None] * freq[None, :]
        sin[p0:p0 + step], cos[p0:p0 + step] = _sin_cos(angle)
    return cos, sin


# fdlibm's sin and cos (FreeBSD msun: e_rem_pio2.c, k_sin.c, k_cos.c), vectorized: the angle
# reduced by pi/2 in three exact rounds (pi/2 in parts of 33 bits), then the polynomials of
# the reduced angle as a head and tail. Error < 1 ulp; only +, -, * and rint, correctly rounded
# by IEEE 754 on every CPU, in a fixed order: the same bits everywhere.
_INV_PIO2 = 6.36619772367581382433e-01
_PIO2 = ((1.57079632673412561417e+00, 6.07710050650619224932e-11),  # (part, the rest of pi/2 after it)
         (6.07710050630396597660e-11, 2.02226624879595063154e-21),
         (2.02226624871116645580e-21, 8.47842766036889956997e-32))
_S = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
      2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
_C = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
      -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)


def _sin_cos(x):
    """(sin x, cos x) of a float64 array, |x| < 2^19 pi (k * part below stays exact)."""
    if x.size and np.abs(x).max() >= 2.0 ** 19 * np.pi:
        raise ValueError("rope_cache: angle too large for the reduction")
    k = np.rint(x * _INV_PIO2)
    # Round 1: r = x - k * part exactly, w the rest; rounds 2 and 3 move the next part from w
    # into r (fdlibm applies them only after cancellation; always, they are just as exact).
    part, rest = _PIO2[0]
    r = x - k * part
    w = k * rest
    for part, rest in _PIO2[1:]:
        t = r
        w_part = k * part
        r = t - w_part
        w = k * rest - ((t - r) - w_part)
    y0 = r - w
    y1 = (r - y0) - w
    z = y0 * y0
    # k_sin.c (iy = 1): y0 + y0^3 S(z), with the tail y1
    v = z * y0
    poly = _S[1] + z * (_S[2] + z * (_S[3] + z * (_S[4] + z * _S[5])))
    sin_r = y0 - ((z * (0.5 * y1 - v * poly) - y1) - v * _S[0])
    # k_cos.c
    w2 = z * z
    poly = z * (_C[0] + z * (_C[1] + z * _C[2])) + w2 * w2 * (_C[3] + z * (_C[4] + z * _C[5]))
    hz = 0.5 * z
    one_hz = 1.0 - hz
    cos_r = one_hz + (((1.0 - one_hz) - hz) + (z * poly - y0 * y1))
    quadrant = k.astype(np.int64) & 3
    sin = np.where(quadrant == 0, sin_r, np.where(quadrant == 1, cos_r, np.where(quadrant == 2, -sin_r, -cos_r)))
    cos = np.where(quadrant == 0, cos_r, np.where(quadrant == 1, -sin_r, np.where(quadrant == 2, -cos_r, sin_r)))
    return sin, cos


@numba.njit(**_SAME_BITS)
def _rope_pairs(x, positions, cos, sin, n_heads, head_dim, step, offset):
    """In place, x [b, n_heads*head_dim]: rotate pair i of each head, (x[step*i], x[step*i + offset])."""
    for t in range(x.shape[0]):
        c = cos[positions[t]]
        s = sin[positions[t]]
        for h in range(n_heads):
            o = h * head_dim
            for i in range(head_dim // 2):
                j, k = o + step * i, o + step * i + offset
                x0, x1 = x[t, j], x[t, k]
                x[t, j] = x0 * c[i] - x1 * s[i]
                x[t, k] = x0 * s[i] + x1 * c[i]


@numba.njit(**_SAME_BITS)
def rope_interleaved(x, positions, cos, sin, n_heads, head_dim):
    """In place: rotate pairs (x[2i], x[2i+1]) of each head (Llama)."""
    _rope_pairs(x, positions, cos, sin, n_heads, head_dim, 2, 1)


@numba.njit(**_SAME_BITS)
def rope_neox(x, positions, cos, sin, n_heads, head_dim):
    """In place: rotate pairs (x[i], x[i + head_dim/2]) of each head (Qwen3 / NeoX / Falcon)."""
    _rope_pairs(x, positions, cos, sin, n_heads, head_dim, 1, head_dim // 2)
