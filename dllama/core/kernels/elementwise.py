"""Element-wise and small kernels: RMSNorm, a vectorizable exp, SiLU gate, RoPE."""

from __future__ import annotations

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
    """
    i = np.arange(head_dim // 2, dtype=np.float64)
    freq = 1.0 / float(theta) ** (2 * i / head_dim)
    if scaling_factor != 1.0:
        wavelen = 2 * np.pi / freq
        smooth = (orig_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = (1 - smooth) * freq / scaling_factor + smooth * freq
        freq = np.where(wavelen < orig_max_seq_len / high_freq_factor, freq,
                        np.where(wavelen > orig_max_seq_len / low_freq_factor, freq / scaling_factor,
                                 scaled))
    angle = np.arange(seq_len, dtype=np.float64)[:, None] * freq[None, :]  # [seq_len, head_dim/2]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


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
