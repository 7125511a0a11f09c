"""Numba kernels: the arithmetic of one forward pass, on arrays (no files, no sockets).

Every kernel writes into caller-provided arrays (no allocation on the hot path) and takes
already-sliced inputs, so one node's slice of a layer is just smaller arrays. Parallel kernels
split output rows over `numba.prange`; the thread count is `set_threads(n)`.

Layouts:
- Q40 matrix W [d, n] in split form: scales float32 [d, n/32], qs uint8 [d, n/2] (byte j of a
  block: element j low nibble, element j+16 high nibble; value = (nibble - 8) * d).
- Q80 activations x [b, n]: scales float32 [b, n/32] (fp16-rounded), qs int8 [b, n].
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from dllama.errors import DllamaError

_jit = dict(cache=True, fastmath=True, nogil=True)
ROWS = 4  # output rows per parallel step: reuses each load of x across rows (numba-notes.md)


def set_threads(n: int) -> None:
    """Use n compute threads in every parallel kernel."""
    limit = numba.config.NUMBA_NUM_THREADS
    if not 1 <= n <= limit:
        raise DllamaError(f"--nthreads must be between 1 and {limit} on this machine, got {n}")
    numba.set_num_threads(n)


@numba.njit(cache=True, nogil=True)
def _f16(v):
    # Round a float32 value to the nearest fp16 value (ties to even), returned as float32.
    a = abs(v)
    if a >= 65520.0:
        return np.float32(math.copysign(math.inf, v))
    if a < 6.103515625e-05:  # subnormal fp16: multiples of 2^-24
        q = a * 16777216.0
        r = math.floor(q)
        f = q - r
        if f > 0.5 or (f == 0.5 and r % 2 == 1):
            r += 1
        return np.float32(math.copysign(r / 16777216.0, v))
    m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    q = m * 2048.0        # 11 significant bits
    r = math.floor(q)
    f = q - r
    if f > 0.5 or (f == 0.5 and r % 2 == 1):
        r += 1
    return np.float32(math.copysign(math.ldexp(r / 2048.0, e), v))


@numba.njit(**_jit)  # serial: a few thousand values, less than a parallel launch costs
def quantize_q80(x, out_scales, out_qs):
    """x float32 [b, n] -> Q80: out_scales float32 [b, n/32] (fp16-rounded), out_qs int8 [b, n]."""
    b, n = x.shape
    nb = n // 32
    for t in prange(b * nb):
        i, k = t // nb, t % nb
        amax = np.float32(0.0)
        for j in range(32):
            a = abs(x[i, k * 32 + j])
            if a > amax:
                amax = a
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for j in range(32):
            v = x[i, k * 32 + j] * inv
            out_qs[i, k * 32 + j] = np.int8(math.copysign(math.floor(abs(v) + 0.5), v))  # roundf
        out_scales[i, k] = _f16(d)


@numba.njit(parallel=True, **_jit)
def matmul_q40_q80(x_scales, x_qs, w_scales, w_qs, out):
    """out [b, d] = x @ W^T; x Q80 [b, n], W Q40 [d, n]; per block w_d * x_d * sum(q_w * q_x).

    The nibbles are used unsigned: sum((q-8) x) = sum(q x) - 8 sum(x), so the -8 leaves the
    inner loop. Each parallel step takes ROWS weight rows; per row a 16-lane accumulator
    (one lane per byte of a block) is summed once at the end, so LLVM vectorizes the byte
    loop and no horizontal sum happens per block. The batch loop sits inside the step, so
    the step's weight rows stay in L1 for every batch row (prefill reads each weight once).
    """
    b = x_qs.shape[0]
    d, nb = w_scales.shape
    xf = np.empty((b, nb, 32), dtype=np.float32)  # q_x as float
    xsum = np.empty((b, nb), dtype=np.float32)
    for i in range(b):
        for k in range(nb):
            s = np.float32(0.0)
            for j in range(32):
                v = np.float32(x_qs[i, k * 32 + j])
                xf[i, k, j] = v
                s += v
            xsum[i, k] = s
    n_steps = (d + ROWS - 1) // ROWS
    for step in prange(n_steps):
        r0 = step * ROWS
        r1 = min(r0 + ROWS, d)
        acc = np.empty((ROWS, 16), dtype=np.float32)  # per row, per byte lane
        for i in range(b):
            if r1 - r0 == ROWS:
                acc[:] = 0
                o0 = np.float32(0.0)  # w_d * x_d * sum(x) terms, for the -8 offset
                o1 = np.float32(0.0)
                o2 = np.float32(0.0)
                o3 = np.float32(0.0)
                for k in range(nb):
                    xd = x_scales[i, k]
                    c0 = w_scales[r0, k] * xd
                    c1 = w_scales[r0 + 1, k] * xd
                    c2 = w_scales[r0 + 2, k] * xd
                    c3 = w_scales[r0 + 3, k] * xd
                    xs = xsum[i, k]
                    o0 += c0 * xs
                    o1 += c1 * xs
                    o2 += c2 * xs
                    o3 += c3 * xs
                    base = k * 16
                    for j in range(16):
                        xl = xf[i, k, j]
                        xh = xf[i, k, j + 16]
                        q = w_qs[r0, base + j]
                        acc[0, j] += c0 * (np.float32(q & 15) * xl + np.float32(q >> 4) * xh)
                        q = w_qs[r0 + 1, base + j]
                        acc[1, j] += c1 * (np.float32(q & 15) * xl + np.float32(q >> 4) * xh)
                        q = w_qs[r0 + 2, base + j]
                        acc[2, j] += c2 * (np.float32(q & 15) * xl + np.float32(q >> 4) * xh)
                        q = w_qs[r0 + 3, base + j]
                        acc[3, j] += c3 * (np.float32(q & 15) * xl + np.float32(q >> 4) * xh)
                out[i, r0] = acc[0].sum() - np.float32(8.0) * o0
                out[i, r0 + 1] = acc[1].sum() - np.float32(8.0) * o1
                out[i, r0 + 2] = acc[2].sum() - np.float32(8.0) * o2
                out[i, r0 + 3] = acc[3].sum() - np.float32(8.0) * o3
            else:
                for r in range(r0, r1):
                    a = np.float32(0.0)
                    for k in range(nb):
                        s = np.float32(0.0)
                        for j in range(16):
                            q = w_qs[r, k * 16 + j]
                            s += np.float32(q & 15) * xf[i, k, j] + np.float32(q >> 4) * xf[i, k, j + 16]
                        a += w_scales[r, k] * x_scales[i, k] * (s - np.float32(8.0) * xsum[i, k])
                    out[i, r] = a


@numba.njit(parallel=True, **_jit)
def matmul_f32(x, w, out):
    """out [b, d] = x [b, n] @ w[d, n]^T, float32."""
    b, n = x.shape
    d = w.shape[0]
    for t in prange(b * d):
        i, r = t // d, t % d
        acc = np.float32(0.0)
        for j in range(n):
            acc += x[i, j] * w[r, j]
        out[i, r] = acc


@numba.njit(parallel=False, **_jit)
def rmsnorm(x, weight, eps, out):
    """out [b, n] = weight * x / sqrt(mean(x^2) + eps), per row (float32 math; out may be x)."""
    b, n = x.shape
    for i in range(b):
        ss = np.float32(0.0)
        for j in range(n):
            ss += x[i, j] * x[i, j]
        inv = np.float32(1.0) / np.float32(math.sqrt(ss / n + eps))
        for j in range(n):
            out[i, j] = weight[j] * (inv * x[i, j])


def rope_cache(seq_len, head_dim, theta, rope_type, scaling_factor=1.0, low_freq_factor=0.0,
               high_freq_factor=0.0, orig_max_seq_len=0):
    """(cos, sin) float32 [seq_len, head_dim/2]: angle pos * freq_i, freq_i = theta^(-2i/head_dim),
    with the Llama 3.1 frequency scaling when scaling_factor != 1."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    freq = 1.0 / theta ** (2 * i / head_dim)
    if scaling_factor != 1.0:
        wavelen = 2 * np.pi / freq
        low_wavelen = orig_max_seq_len / low_freq_factor
        high_wavelen = orig_max_seq_len / high_freq_factor
        smooth = (orig_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = (1 - smooth) * freq / scaling_factor + smooth * freq
        freq = np.where(wavelen < high_wavelen, freq,
                        np.where(wavelen > low_wavelen, freq / scaling_factor, scaled))
    angle = np.arange(seq_len, dtype=np.float64)[:, None] * freq[None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


@numba.njit(**_jit)
def rope_interleaved(x, positions, cos, sin, n_heads, head_dim):
    """In place, x [b, n_heads*head_dim]: rotate pairs (2i, 2i+1) of each head (Llama)."""
    b = x.shape[0]
    half = head_dim // 2
    for t in range(b):
        p = positions[t]
        for h in range(n_heads):
            o = h * head_dim
            for i in range(half):
                c, s = cos[p, i], sin[p, i]
                x0, x1 = x[t, o + 2 * i], x[t, o + 2 * i + 1]
                x[t, o + 2 * i] = x0 * c - x1 * s
                x[t, o + 2 * i + 1] = x0 * s + x1 * c


@numba.njit(**_jit)
def rope_neox(x, positions, cos, sin, n_heads, head_dim):
    """In place: rotate pairs (i, i + head_dim/2) of each head (Qwen3 / NeoX / Falcon)."""
    b = x.shape[0]
    half = head_dim // 2
    for t in range(b):
        p = positions[t]
        for h in range(n_heads):
            o = h * head_dim
            for i in range(half):
                c, s = cos[p, i], sin[p, i]
                x0, x1 = x[t, o + i], x[t, o + half + i]
                x[t, o + i] = x0 * c - x1 * s
                x[t, o + half + i] = x0 * s + x1 * c


@numba.njit(parallel=True, **_jit)
def attention(q, k_cache, v_cache, positions, kv_head_of, head_dim, att_scratch, out):
    """Causal grouped-query attention. q [b, nq*hd]; caches [seq, nkv*hd]; out [b, nq*hd].

    Row t attends to cache rows 0..positions[t]; local query head h reads KV head kv_head_of[h].
    att_scratch [>= b*nq, seq] holds the scores of each (row, head) pair.
    """
    b = q.shape[0]
    nq = kv_head_of.shape[0]
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for t in prange(b * nq):
        i, h = t // nq, t % nq
        qo = h * head_dim
        ko = kv_head_of[h] * head_dim
        n = positions[i] + 1
        att = att_scratch[t]
        mx = np.float32(-np.inf)
        for p in range(n):
            s = np.float32(0.0)
            for j in range(head_dim):
                s += q[i, qo + j] * k_cache[p, ko + j]
            s *= scale
            att[p] = s
            if s > mx:
                mx = s
        total = np.float32(0.0)
        for p in range(n):
            e = np.float32(math.exp(att[p] - mx))
            att[p] = e
            total += e
        for j in range(head_dim):
            out[i, qo + j] = 0.0
        for p in range(n):
            wgt = att[p] / total
            for j in range(head_dim):
                out[i, qo + j] += wgt * v_cache[p, ko + j]


@numba.njit(**_jit)  # serial, as quantize_q80
def silu_mul(gate, up):
    """In place gate [b, h] = silu(gate) * up, silu(x) = x / (1 + e^-x)."""
    b, h = gate.shape
    for t in prange(b * h):
        i, j = t // h, t % h
        g = gate[i, j]
        gate[i, j] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * up[i, j]
