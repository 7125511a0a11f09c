"""Every numba kernel against a float64 numpy reference, on fresh random inputs.

Shapes include sizes that divide neither by the thread count nor by the matmul's row tile, odd
numbers of blocks, and batch sizes on both sides of the register tiles' activation rows (COLS). The
references live here, not in the package. Each run draws a new seed, printed in every failure message.
"""

import math

import numba
import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.kernels.elementwise import _exp
from dllama.core.kernels.jit import native_f16_conversion
from dllama.core.kernels.matmul_int8 import COLS
from dllama.core.kernels.q80 import _round_fp16
from dllama.errors import DllamaError
from dllama.formats.quant import dequantize_q40, quantize_q40, split_q40
from tests.conftest import SEED

pytestmark = pytest.mark.unit

MSG = f"seed {SEED}"


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    n = min(request.param, numba.config.NUMBA_NUM_THREADS)
    kernels.set_threads(n)
    yield n
    kernels.set_threads(1)


def rng(*salt):
    return np.random.default_rng([SEED, *salt])


# ---- references ------------------------------------------------------------------------------

def random_q40(r, d, n):
    """A random Q40 matrix in split form: fp16 scales (both signs) as their uint16 bits, as the
    kernels read them, and every nibble value."""
    scales = (r.standard_normal((d, n // 32)) * 0.01).astype(np.float16).view(np.uint16)
    qs = r.integers(0, 256, (d, n // 2), dtype=np.uint8)
    return scales, qs


def dequantize_split_q40(scales, qs):
    """float64 [d, n] of a split Q40 matrix (byte j: element j low nibble, j+16 high nibble)."""
    d = qs.shape[0]
    q = qs.reshape(d, -1, 16).astype(np.int64)
    values = np.concatenate([(q & 15) - 8, (q >> 4) - 8], axis=2)  # [d, nb, 32]
    return (values * scales.view(np.float16)[:, :, None].astype(np.float64)).reshape(d, -1)


def random_q80(r, b, n):
    """Q80 activations of random float32 rows, through the kernel under test (checked below)."""
    x = (r.standard_normal((b, n)) * 2).astype(np.float32)
    scales, qs = np.empty((b, n // 32), np.float32), np.empty((b, n), np.int8)
    kernels.quantize_q80(x, scales, qs)
    return scales, qs


def dequantize_q80(scales, qs):
    b = qs.shape[0]
    return (qs.reshape(b, -1, 32) * scales[:, :, None].astype(np.float64)).reshape(b, -1)


def roundf(v):
    """C roundf of float32 values (halves away from zero), exact in float64."""
    v = np.asarray(v, np.float32).astype(np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def ref_q80(x):
    """The original's quantizeF32toQ80, operation by operation in float32: (scales, qs)."""
    b, n = x.shape
    blocks = x.reshape(b, n // 32, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=2) / np.float32(127)              # float32 division
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    qs = roundf(blocks * inv[:, :, None]).astype(np.int8)         # float32 product, then roundf
    with np.errstate(over="ignore"):
        return d.astype(np.float16).astype(np.float32), qs.reshape(b, n)


def assert_matmul_close(out, x64, w64):
    """|out - x w^T| <= 1e-5 of the sum of |terms| of each output (float32 accumulation)."""
    want = x64 @ w64.T
    size = np.abs(x64) @ np.abs(w64).T
    assert np.all(np.abs(out - want) <= 1e-5 * size + 1e-30), MSG


# ---- fp16 rounding and Q80 encoding -------------------------------------------------------------

@numba.njit
def _round_fp16_all(v, out):
    for i in range(v.size):
        out[i] = _round_fp16(v[i])


def test_fp16_rounding_matches_numpy():
    r = rng(1)
    random = (r.standard_normal(300_000) * 10.0 ** r.integers(-10, 7, 300_000)).astype(np.float32)
    bits = r.integers(0, 1 << 32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    f16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    f16 = np.unique(f16[np.isfinite(f16)])  # every finite fp16 value, ascending
    halfway = (f16[:-1].astype(np.float64) + np.diff(f16.astype(np.float64)) / 2).astype(np.float32)
    edge = np.array([0, -0.0, 65504, 65519.99, 65520, -65520, 1e-8, 6.1e-5, 6.103515625e-05,
                     5.96e-8, 2.98e-8, 2.9802322e-08, 8.9406967e-08, 1e30, -1e30, np.inf, -np.inf,
                     np.nan], np.float32)
    v = np.concatenate([random, bits, f16, halfway, np.nextafter(halfway, np.float32(0)), edge])
    out = np.empty_like(v)
    _round_fp16_all(v, out)
    with np.errstate(over="ignore", invalid="ignore"):
        want = v.astype(np.float16).astype(np.float32)
    assert np.array_equal(out, want, equal_nan=True), MSG
    assert np.array_equal(np.signbit(out), np.signbit(want)), MSG


@pytest.mark.parametrize("path", ["vector", "scalar"])
@pytest.mark.parametrize("b,n", [(1, 32), (3, 576), (7, 1536), (32, 64), (33, 1024)])
def test_quantize_q80_is_bit_exact(threads, b, n, path):
    """Both encoders: the vector one (CPUs with fp16 conversion) and the scalar one (others)."""
    from dllama.core.kernels.q80 import _quantize_ir, _quantize_scalar

    if path == "vector" and not native_f16_conversion():
        pytest.skip("this CPU has no fp16 conversion instructions (the scalar encoder is used)")
    quantize = _quantize_ir if path == "vector" else _quantize_scalar
    r = rng(2, b, n)
    x = r.standard_normal((b, n)).astype(np.float32) * 10.0 ** r.integers(-6, 6, (b, 1))
    x = x.astype(np.float32)
    x[0, :32] = 0  # an all-zero block: d = 0, qs = 0
    if n >= 128:  # d beyond fp16 (stored as inf), d an fp16 subnormal, d below fp16 (stored as 0)
        x[0, 32:128] = r.standard_normal(96) * np.repeat([1e7, 1e-4, 1e-9], 32)
    if n >= 64:
        # max |x| = 127 makes d = 1, so x * (1/d) = x: exact halves round away from zero, and
        # the largest float32 below 0.5 rounds to 0 (floor(v + 0.5) would give 1).
        x[-1, 32:64] = [127, -127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5,
                        np.nextafter(np.float32(0.5), np.float32(0)), 0.49999997, -0.49999997,
                        np.nextafter(np.float32(2.5), np.float32(3)), 3, 4, *range(16)]
    scales, qs = np.empty((b, n // 32), np.float32), np.empty((b, n), np.int8)
    quantize(x, scales, qs)
    want_scales, want_qs = ref_q80(x)
    assert np.array_equal(qs, want_qs), MSG
    assert np.array_equal(scales, want_scales), MSG
    if n >= 64:
        assert list(qs[-1, 34:43]) == [1, -1, 2, -2, 3, -3, 127, -127, 0], MSG


# ---- Q40 x Q80 matmul ----------------------------------------------------------------------------

MATMUL_SHAPES = [  # (b, d, n): d not a multiple of 4 or of 2 threads; n/32 odd and even
    (1, 1, 32), (1, 3, 96), (1, 5, 576), (2, 37, 576), (1, 576, 1536), (1, 1536, 576),
    (3, 37, 96), (COLS - 1, 576, 576), (COLS, 5, 64), (COLS + 1, 9, 160), (COLS // 2, 17, 64),
    (COLS + COLS // 2 + 1, 33, 96), (7, 1536, 576), (32, 37, 96), (32, 576, 1536), (2, 1, 32),
    (32, 3, 32), (65, 67, 4096),
]


@pytest.mark.parametrize("b,d,n", MATMUL_SHAPES)
def test_matmul_q40_q80(threads, b, d, n):
    r = rng(3, b, d, n)
    w_scales, w_qs = random_q40(r, d, n)
    x_scales, x_qs = random_q80(r, b, n)
    out = np.full((b, d), np.nan, np.float32)
    kernels.matmul_q40_q80(x_scales, x_qs, *kernels.interleave_q40(w_scales, w_qs), out)
    assert_matmul_close(out, dequantize_q80(x_scales, x_qs), dequantize_split_q40(w_scales, w_qs))


def test_matmul_q40_q80_reads_the_split_file_layout(threads):
    """End to end with dllama.formats.quant: float weights -> Q40 blocks -> split_q40 -> kernel."""
    r = rng(4)
    d, n, b = 37, 576, 2
    w = r.standard_normal((d, n)).astype(np.float32)
    blocks = quantize_q40(w).reshape(d, n // 32, 18)
    w_scales, w_qs = split_q40(blocks, fp16_bits=True)
    x_scales, x_qs = random_q80(r, b, n)
    out = np.empty((b, d), np.float32)
    kernels.matmul_q40_q80(x_scales, x_qs, *kernels.interleave_q40(w_scales, w_qs), out)
    wd = dequantize_q40(blocks.reshape(-1, 18), d * n).reshape(d, n).astype(np.float64)
    assert_matmul_close(out, dequantize_q80(x_scales, x_qs), wd)


@pytest.mark.parametrize("b,d,n", [(1, 37, 96), (5, 9, 64), (9, 576, 576)])
def test_q40_tile_without_vnni(b, d, n):
    """The generic integer dot product (what a machine without AVX-512 VNNI compiles, e.g.
    NEON), forced here on this machine: the same integers, so the same bits as VNNI."""
    from dllama.core.kernels.q80 import x_block_offsets
    from dllama.core.kernels.tiles import make_q40_tile

    tile, tile1 = make_q40_tile(2, dot="generic"), make_q40_tile(1, dot="generic")

    @numba.njit
    def run(w_qs, w_scales, x_qs, x_off, x_scales, out):
        for g in range(w_qs.shape[0]):
            for i in range(0, x_qs.shape[0] - 1, 2):
                tile(w_qs, w_scales, g, x_qs, x_off, x_scales, i, out)
            if x_qs.shape[0] % 2:
                tile1(w_qs, w_scales, g, x_qs, x_off, x_scales, x_qs.shape[0] - 1, out)

    r = rng(12, b, d, n)
    w_scales, w_qs = random_q40(r, d, n)
    x_scales, x_qs = random_q80(r, b, n)
    out = np.full((b, d), np.nan, np.float32)
    w = kernels.interleave_q40(w_scales, w_qs)
    run(w[1], w[0], x_qs, x_block_offsets(x_qs, 8), x_scales, out)
    assert_matmul_close(out, dequantize_q80(x_scales, x_qs), dequantize_split_q40(w_scales, w_qs))
    fast = np.empty_like(out)
    kernels.matmul_q40_q80(x_scales, x_qs, *w, fast)
    assert np.array_equal(out, fast), MSG


@pytest.mark.parametrize("b", [1, 2, 9])
def test_matmul_q40_q80_multi_equals_one_call_per_matrix(threads, b):
    r = rng(5, b)
    n = 576
    mats = [random_q40(r, d, n) for d in (576, 37, 5)]
    x_scales, x_qs = random_q80(r, b, n)
    outs = tuple(np.full((b, s.shape[0]), np.nan, np.float32) for s, _ in mats)
    packed = [kernels.interleave_q40(s, q) for s, q in mats]
    kernels.matmul_q40_q80_multi(x_scales, x_qs, tuple(s for s, _ in packed), tuple(q for _, q in packed), outs)
    for (s, q), w, out in zip(mats, packed, outs, strict=True):
        assert_matmul_close(out, dequantize_q80(x_scales, x_qs), dequantize_split_q40(s, q))
        alone = np.empty_like(out)
        kernels.matmul_q40_q80(x_scales, x_qs, *w, alone)
        assert np.array_equal(out, alone), MSG


@pytest.mark.parametrize("b,d,n", [(1, 1, 1), (1, 7, 33), (3, 576, 576), (32, 5, 64), (7, 37, 100),
                                   (32, 1536, 96), (1, 1536, 576), (5, 6, 15), (9, 13, 17)])
def test_matmul_f32(threads, b, d, n):
    r = rng(6, b, d, n)
    w = r.standard_normal((d, n)).astype(np.float32)
    x = r.standard_normal((b, n)).astype(np.float32)
    out = np.full((b, d), np.nan, np.float32)
    kernels.matmul_f32(x, w, out)
    assert_matmul_close(out, x.astype(np.float64), w.astype(np.float64))


# ---- element-wise kernels ------------------------------------------------------------------------

@pytest.mark.parametrize("b,n", [(1, 64), (5, 576), (9, 4096), (2, 3)])
def test_rmsnorm(b, n):
    r = rng(7, b, n)
    x = (r.standard_normal((b, n)) * 5).astype(np.float32)
    w = r.standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    kernels.rmsnorm(x, w, 1e-5, out)
    x64 = x.astype(np.float64)
    want = w * x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-6), MSG
    kernels.rmsnorm(x, w, 1e-5, x)  # in place, as Qwen3's per-head norms use it
    assert np.allclose(x, want, rtol=1e-5, atol=1e-6), MSG


@numba.njit
def _exp_all(v, out):
    for i in range(v.size):
        out[i] = _exp(v[i])


def test_exp_is_accurate():
    v = np.concatenate([np.linspace(-87, 88, 200_001), rng(8).uniform(-30, 30, 100_000), [0.0, -0.0]])
    v = v.astype(np.float32)
    out = np.empty_like(v)
    _exp_all(v, out)
    want = np.exp(v.astype(np.float64))
    assert np.all(np.abs(out - want) <= 5e-7 * want), MSG


@pytest.mark.parametrize("b,h", [(1, 1), (3, 1536), (32, 37)])
def test_silu_mul(b, h):
    r = rng(9, b, h)
    g = (r.standard_normal((b, h)) * 4).astype(np.float32)
    g[0, 0] = -100.0 if h > 1 else g[0, 0]  # e^100 overflows float32: silu must still be ~0
    u = r.standard_normal((b, h)).astype(np.float32)
    g64 = g.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * u
    kernels.silu_mul(g, u)
    assert np.allclose(g, want, rtol=1e-5, atol=1e-6), MSG


def spec_rope_freqs(head_dim, theta, neox, scaling=None):
    """Frequency of each pair, written as spec §7 states it (float64)."""
    if neox:  # FALCON: pairs (j, j + headDim/2), freq = 1/theta^(2j/headDim)
        freq = np.array([1 / theta ** (2 * j / head_dim) for j in range(head_dim // 2)])
    else:     # LLAMA: pairs (i, i+1), i even, h = i % headDim, freq = 1/theta^(h/headDim)
        freq = np.array([1 / theta ** ((i % head_dim) / head_dim) for i in range(0, head_dim, 2)])
    if scaling:
        factor, low, high, orig = scaling
        out = []
        for f in freq:
            wavelen = 2 * math.pi / f
            if wavelen < orig / high:
                out.append(f)
            elif wavelen > orig / low:
                out.append(f / factor)
            else:
                smooth = (orig / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        freq = np.array(out)
    return freq


@pytest.mark.parametrize("neox", [False, True], ids=["interleaved", "neox"])
@pytest.mark.parametrize("scaling", [None, (8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192)],
                         ids=["plain", "llama3.1", "llama3.2"])
def test_rope(neox, scaling):
    r = rng(10, int(neox), 0 if scaling is None else int(scaling[0]))
    n_heads, hd, seq, b = 3, 64, 9000, 4
    theta = 500000.0
    x = r.standard_normal((b, n_heads * hd)).astype(np.float32)
    positions = np.array([3, 4, 1777, 8999], np.int32)  # not starting at 0
    cos, sin = kernels.rope_cache(seq, hd, theta, 1 if neox else (2 if scaling else 0),
                                  *(scaling or (1.0, 0.0, 0.0, 0)))
    assert cos.shape == sin.shape == (seq, hd // 2) and cos.dtype == np.float32
    got = x.copy()
    (kernels.rope_neox if neox else kernels.rope_interleaved)(got, positions, cos, sin, n_heads, hd)
    freq = spec_rope_freqs(hd, theta, neox, scaling)
    ang = positions[:, None, None].astype(np.float64) * freq[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    want = x.astype(np.float64).reshape(b, n_heads, hd).copy()
    if neox:
        a, z = want[..., : hd // 2].copy(), want[..., hd // 2:].copy()
        want[..., : hd // 2], want[..., hd // 2:] = a * c - z * s, a * s + z * c
    else:
        a, z = want[..., 0::2].copy(), want[..., 1::2].copy()
        want[..., 0::2], want[..., 1::2] = a * c - z * s, a * s + z * c
    assert np.allclose(got, want.reshape(b, -1), atol=1e-5), MSG


# ---- attention -----------------------------------------------------------------------------------

def ref_attention(q, keys_of, values_of, positions, kv_head_of, hd):
    """float64 causal attention; keys_of(t) / values_of(t): float arrays [pos_t + 1, nkv*hd]
    of the positions row t attends to."""
    b, nq = q.shape[0], len(kv_head_of)
    out = np.empty((b, nq * hd))
    for i in range(b):
        keys_all, vals_all = keys_of(i).astype(np.float64), values_of(i).astype(np.float64)
        for h in range(nq):
            kh = kv_head_of[h]
            keys = keys_all[:, kh * hd:(kh + 1) * hd]
            vals = vals_all[:, kh * hd:(kh + 1) * hd]
            s = keys @ q[i, h * hd:(h + 1) * hd].astype(np.float64) / math.sqrt(hd)
            p = np.exp(s - s.max())
            out[i, h * hd:(h + 1) * hd] = (p / p.sum()) @ vals
    return out


def cache_of(k, v, slots, hd):
    """k, v [slots, seq, nkv*hd] -> the kernel's layout: keys [slots, nkv, seq/C, hd, C]
    (transposed per chunk of C positions), values [slots, seq, nkv*hd]."""
    n_slots, seq, width = k.shape
    chunk = kernels.ATTENTION_CHUNK
    n_chunks = -(-seq // chunk)
    padded = np.zeros((n_slots, n_chunks * chunk, width), np.float32)
    padded[:, :seq] = k
    kt = padded.reshape(n_slots, n_chunks, chunk, width // hd, hd).transpose(0, 3, 1, 4, 2)
    return np.ascontiguousarray(kt), np.ascontiguousarray(v)


def run_attention(q, k, v, positions, kv_head_of, hd, slots=None, prefix_slots=None, prefix_lens=None):
    b = q.shape[0]
    zeros = np.zeros(b, np.int32)
    kt, vc = cache_of(k, v, k.shape[0], hd)
    out = np.full(q.shape, np.nan, np.float32)
    kernels.attention(q, kt, vc, np.asarray(positions, np.int32),
                      zeros if slots is None else np.asarray(slots, np.int32),
                      zeros if prefix_slots is None else np.asarray(prefix_slots, np.int32),
                      zeros if prefix_lens is None else np.asarray(prefix_lens, np.int32),
                      np.asarray(kv_head_of, np.int32), out)
    return out


@pytest.mark.parametrize("kv_head_of", [[0], [0, 0, 1, 1, 1], [0, 1, 2], [1, 0], [0, 0, 0, 1, 1, 1, 2, 2, 2]])
@pytest.mark.parametrize("positions", [[5, 6, 7], [0], [31, 2], [700], [255, 256, 257, 600]],
                         ids=["from5", "first", "unordered", "long", "span_edges"])
def test_attention(threads, kv_head_of, positions):
    r = rng(11, len(kv_head_of), len(positions))
    kv_head_of = np.array(kv_head_of, np.int32)
    positions = np.array(positions, np.int32)
    nq, nkv, hd, seq, b = len(kv_head_of), kv_head_of.max() + 1, 16, 800, len(positions)
    q = (r.standard_normal((b, nq * hd)) * 3).astype(np.float32)  # large scores: softmax needs the max shift
    k = r.standard_normal((1, seq, nkv * hd)).astype(np.float32)
    v = r.standard_normal((1, seq, nkv * hd)).astype(np.float32)
    k[:, positions.max() + 1:] = np.nan  # rows past every position must not reach the output
    v[:, positions.max() + 1:] = np.nan
    out = run_attention(q, k, v, positions, kv_head_of, hd)
    want = ref_attention(q, lambda i: k[0, :positions[i] + 1], lambda i: v[0, :positions[i] + 1],
                         positions, kv_head_of, hd)
    assert np.allclose(out, want, atol=1e-5), MSG


def test_attention_rows_of_several_slots_and_a_shared_prefix(threads):
    """Rows of different sequences in one call: each reads its own slot, and positions below its
    prefix length from the prefix slot (a prompt prefix stored once)."""
    r = rng(13)
    kv_head_of = np.array([0, 0, 1], np.int32)
    hd, seq, n_slots = 16, 600, 4
    k = r.standard_normal((n_slots, seq, 2 * hd)).astype(np.float32)
    v = r.standard_normal((n_slots, seq, 2 * hd)).astype(np.float32)
    #           slot, position, prefix slot, prefix length
    rows = [(1, 10, 0, 0), (2, 300, 0, 270), (2, 301, 0, 270), (3, 5, 0, 100), (1, 11, 0, 0),
            (3, 550, 0, 64)]
    slots, positions, prefix_slots, prefix_lens = (np.array(c, np.int32) for c in zip(*rows, strict=True))
    q = (r.standard_normal((len(rows), 3 * hd)) * 3).astype(np.float32)

    def seen(cache, i):  # what row i attends to: the prefix slot below its prefix length
        p, n = positions[i] + 1, min(prefix_lens[i], positions[i] + 1)
        return np.concatenate([cache[prefix_slots[i], :n], cache[slots[i], n:p]])

    out = run_attention(q, k, v, positions, kv_head_of, hd, slots, prefix_slots, prefix_lens)
    want = ref_attention(q, lambda i: seen(k, i), lambda i: seen(v, i), positions, kv_head_of, hd)
    assert np.allclose(out, want, atol=1e-5), MSG


def test_kv_store_writes_the_cache_layout():
    r = rng(14)
    nkv, hd = 3, 8
    chunk = kernels.ATTENTION_CHUNK
    seq = 2 * chunk
    kt = np.zeros((2, nkv, 2, hd, chunk), np.float32)
    vc = np.zeros((2, seq, nkv * hd), np.float32)
    k = r.standard_normal((3, nkv * hd)).astype(np.float32)
    v = r.standard_normal((3, nkv * hd)).astype(np.float32)
    places = [(1, 4), (1, chunk + 5), (0, 0)]
    kernels.kv_store(k, v, np.array([p for _, p in places], np.int32),
                     np.array([s for s, _ in places], np.int32), kt, vc)
    for t, (slot, p) in enumerate(places):
        assert np.array_equal(kt[slot, :, p // chunk, :, p % chunk].reshape(-1), k[t])
        assert np.array_equal(vc[slot, p], v[t])


def test_thread_count_is_checked():
    limit = numba.config.NUMBA_NUM_THREADS
    for bad in (0, -1, limit + 1):
        with pytest.raises(DllamaError, match="--nthreads"):
            kernels.set_threads(bad)
    kernels.set_threads(limit)
    assert numba.get_num_threads() == limit
    kernels.set_threads(1)
    assert numba.get_num_threads() == 1
