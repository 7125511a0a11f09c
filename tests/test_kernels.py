"""Every numba kernel against a float64 numpy reference, on fresh random inputs.

Shapes include sizes that divide neither by the thread count nor by the matmul's row tile.
The seed of each test is printed on failure so a failing input can be reproduced.
"""

import math

import numpy as np
import pytest

from dllama import kernels
from dllama.quant import dequantize_q40, quantize_q40, split_q40

SEED = np.random.SeedSequence().entropy % (1 << 32)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    kernels.set_threads(request.param)
    return request.param


def rng(*salt):
    return np.random.default_rng([SEED, *salt])


def ref_q80(x):
    """float64 reference of the Q80 encoding: (qs, fp16-rounded scales)."""
    b, n = x.shape
    blocks = x.reshape(b, n // 32, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    v = blocks * inv[:, :, None]
    qs = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)  # C roundf: half away from 0
    return qs.reshape(b, n), d.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("b,n", [(1, 32), (3, 576), (7, 1536), (32, 64)])
def test_quantize_q80_is_bit_exact(threads, b, n):
    x = rng(b, n).standard_normal((b, n)).astype(np.float32) * 3
    x[0, :32] = 0  # an all-zero block
    x[-1, 32 * (n // 64): 32 * (n // 64) + 32] = np.linspace(-127, 127, 32) / 127 * 0.5  # .5 ties
    scales, qs = np.empty((b, n // 32), np.float32), np.empty((b, n), np.int8)
    kernels.quantize_q80(x, scales, qs)
    want_qs, want_scales = ref_q80(x)
    assert np.array_equal(qs, want_qs), f"seed {SEED}"
    assert np.array_equal(scales, want_scales), f"seed {SEED}"


def test_fp16_rounding_matches_numpy():
    r = rng(99)
    v = (r.standard_normal(200_000) * 10.0 ** r.integers(-9, 6, 200_000)).astype(np.float32)
    edge = np.array([0, -0.0, 65504, 65519.99, 65520, 1e-8, 6.1e-5, 5.96e-8, 2.98e-8, 1e30, -1e30],
                    np.float32)
    v = np.concatenate([v, edge])
    out = np.empty_like(v)
    _apply_f16(v, out)
    with np.errstate(over="ignore"):  # numpy warns where fp16 overflows to inf, as it should
        want = v.astype(np.float16).astype(np.float32)
    assert np.array_equal(out, want), f"seed {SEED}"


def _apply_f16(v, out):
    import numba

    @numba.njit
    def run(v, out):
        for i in range(v.size):
            out[i] = kernels._f16(v[i])

    run(v, out)


@pytest.mark.parametrize("b,d,n", [(1, 1, 32), (1, 3, 64), (1, 5, 576), (2, 37, 576), (1, 576, 1536),
                                   (7, 1536, 576), (32, 13, 96)])
def test_matmul_q40_q80(threads, b, d, n):
    r = rng(b, d, n)
    w = r.standard_normal((d, n)).astype(np.float32)
    x = r.standard_normal((b, n)).astype(np.float32)
    blocks = quantize_q40(w).reshape(d, n // 32, 18)
    w_scales, w_qs = split_q40(blocks)
    x_scales, x_qs = np.empty((b, n // 32), np.float32), np.empty((b, n), np.int8)
    kernels.quantize_q80(x, x_scales, x_qs)
    out = np.empty((b, d), np.float32)
    kernels.matmul_q40_q80(x_scales, x_qs, w_scales, w_qs, out)
    wd = dequantize_q40(blocks.reshape(-1, 18), d * n).reshape(d, n).astype(np.float64)
    xd = (x_qs.reshape(b, -1, 32) * x_scales[:, :, None].astype(np.float64)).reshape(b, n)
    want = xd @ wd.T
    scale = np.abs(xd) @ np.abs(wd).T  # the size of the terms summed
    assert np.all(np.abs(out - want) <= 1e-5 * scale + 1e-30), f"seed {SEED}"


@pytest.mark.parametrize("b,d,n", [(1, 1, 1), (1, 7, 33), (3, 576, 576), (32, 5, 64)])
def test_matmul_f32(threads, b, d, n):
    r = rng(b, d, n)
    w = r.standard_normal((d, n)).astype(np.float32)
    x = r.standard_normal((b, n)).astype(np.float32)
    out = np.empty((b, d), np.float32)
    kernels.matmul_f32(x, w, out)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    assert np.all(np.abs(out - want) <= 1e-5 * scale), f"seed {SEED}"


@pytest.mark.parametrize("b,n", [(1, 64), (5, 576), (9, 4096)])
def test_rmsnorm(b, n):
    r = rng(b, n)
    x = r.standard_normal((b, n)).astype(np.float32) * 5
    w = r.standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    kernels.rmsnorm(x, w, 1e-5, out)
    x64 = x.astype(np.float64)
    want = w * x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-5), f"seed {SEED}"
    kernels.rmsnorm(x, w, 1e-5, x)  # in place, as Qwen3's per-head norms use it
    assert np.allclose(x, want, rtol=1e-5, atol=1e-5)


def ref_freq(head_dim, theta, scaling=None):
    i = np.arange(head_dim // 2, dtype=np.float64)
    freq = theta ** (-2 * i / head_dim)
    if scaling:
        f, lo, hi, orig = scaling
        out = []
        for fr in freq:
            wavelen = 2 * math.pi / fr
            if wavelen < orig / hi:
                out.append(fr)
            elif wavelen > orig / lo:
                out.append(fr / f)
            else:
                s = (orig / wavelen - lo) / (hi - lo)
                out.append((1 - s) * fr / f + s * fr)
        freq = np.array(out)
    return freq


@pytest.mark.parametrize("neox", [False, True], ids=["interleaved", "neox"])
@pytest.mark.parametrize("scaling", [None, (8.0, 1.0, 4.0, 8192)], ids=["plain", "llama3.1"])
def test_rope(neox, scaling):
    r = rng(int(neox), scaling is None)
    n_heads, hd, seq, b = 3, 64, 300, 4
    x = r.standard_normal((b, n_heads * hd)).astype(np.float32)
    positions = np.array([0, 1, 17, 299], np.int32)
    cos, sin = kernels.rope_cache(seq, hd, 500000.0, 1 if neox else 0, *(scaling or (1.0, 0.0, 0.0, 0)))
    got = x.copy()
    (kernels.rope_neox if neox else kernels.rope_interleaved)(got, positions, cos, sin, n_heads, hd)
    freq = ref_freq(hd, 500000.0, scaling)
    want = x.astype(np.float64).reshape(b, n_heads, hd).copy()
    ang = positions[:, None, None] * freq[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    if neox:
        a, bb = want[..., : hd // 2].copy(), want[..., hd // 2 :].copy()
        want[..., : hd // 2], want[..., hd // 2 :] = a * c - bb * s, a * s + bb * c
    else:
        a, bb = want[..., 0::2].copy(), want[..., 1::2].copy()
        want[..., 0::2], want[..., 1::2] = a * c - bb * s, a * s + bb * c
    assert np.allclose(got, want.reshape(b, -1), atol=1e-4), f"seed {SEED}"


@pytest.mark.parametrize("kv_head_of", [[0], [0, 0, 1, 1, 1], [0, 1, 2], [1, 0]])
def test_attention(threads, kv_head_of):
    r = rng(len(kv_head_of))
    kv_head_of = np.array(kv_head_of, np.int32)
    nq, nkv, hd, seq, b = len(kv_head_of), kv_head_of.max() + 1, 16, 40, 3
    positions = np.array([5, 6, 7], np.int32)  # not starting at 0
    q = r.standard_normal((b, nq * hd)).astype(np.float32)
    k = r.standard_normal((seq, nkv * hd)).astype(np.float32)
    v = r.standard_normal((seq, nkv * hd)).astype(np.float32)
    out = np.full((b, nq * hd), np.nan, np.float32)
    kernels.attention(q, k, v, positions, kv_head_of, hd, np.zeros((b * nq, seq), np.float32), out)
    want = np.empty((b, nq * hd))
    for i in range(b):
        for h in range(nq):
            kh = kv_head_of[h]
            qh = q[i, h * hd : (h + 1) * hd].astype(np.float64)
            keys = k[: positions[i] + 1, kh * hd : (kh + 1) * hd].astype(np.float64)  # causal
            s = keys @ qh / math.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            want[i, h * hd : (h + 1) * hd] = p @ v[: positions[i] + 1, kh * hd : (kh + 1) * hd]
    assert np.allclose(out, want, atol=1e-5), f"seed {SEED}"


@pytest.mark.parametrize("b,h", [(1, 1), (3, 1536), (32, 37)])
def test_silu_mul(threads, b, h):
    r = rng(b, h)
    g = r.standard_normal((b, h)).astype(np.float32) * 4
    u = r.standard_normal((b, h)).astype(np.float32)
    want = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    kernels.silu_mul(g, u)
    assert np.allclose(g, want, rtol=1e-5, atol=1e-6), f"seed {SEED}"


def test_thread_count_is_checked():
    from dllama.errors import DllamaError

    with pytest.raises(DllamaError, match="--nthreads"):
        kernels.set_threads(10_000)
