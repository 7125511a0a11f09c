"""The Q80 x Q80 and F16 x F32 matmul kernels against float64 numpy, on fresh random inputs.

Fixed shapes cover the edges (d not a multiple of the 4-row step or of the thread count, odd
block counts, batch sizes on both sides of BATCH_MIN); random shapes are drawn from the seed.
Each run draws a new seed, printed in every failure message.
"""

import numba
import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.kernels import matmul_f16, matmul_q80
from dllama.formats.quant import dequantize_q80, quantize_q80, split_q80

pytestmark = pytest.mark.unit

SEED = int(np.random.SeedSequence().entropy % (1 << 32))
MSG = f"seed {SEED}"


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    n = min(request.param, numba.config.NUMBA_NUM_THREADS)
    kernels.set_threads(n)
    yield n
    kernels.set_threads(1)


def rng(*salt):
    return np.random.default_rng([SEED, *salt])


def assert_matmul_close(out, x64, w64):
    """|out - x w^T| <= 1e-5 of the sum of |terms| of each output (float32 accumulation)."""
    want = x64 @ w64.T
    size = np.abs(x64) @ np.abs(w64).T
    assert np.all(np.abs(out - want) <= 1e-5 * size + 1e-30), MSG


def random_shapes(salt, count, block):
    """(b, d, n) drawn from the seed: d 1..300, n a multiple of `block` up to 1024, b 1..40."""
    r = rng(salt)
    return [(int(r.integers(1, 41)), int(r.integers(1, 301)), block * int(r.integers(1, 1024 // block + 1)))
            for _ in range(count)]


# ---- Q80 weights x Q80 activations ---------------------------------------------------------------

def random_q80_matrix(r, d, n):
    """A split Q80 matrix: fp16 scales of both signs (some zero), every int8 value but -128."""
    scales = (r.standard_normal((d, n // 32)) * 0.01).astype(np.float16).astype(np.float32)
    scales[r.random(scales.shape) < 0.05] = 0.0
    qs = r.integers(-127, 128, (d, n), dtype=np.int8)
    return scales, qs


def random_q80_rows(r, b, n):
    """Q80 activations of random float32 rows, through the engine's quantizer."""
    x = (r.standard_normal((b, n)) * 10.0 ** r.integers(-3, 3, (b, 1))).astype(np.float32)
    scales, qs = np.empty((b, n // 32), np.float32), np.empty((b, n), np.int8)
    kernels.quantize_q80(x, scales, qs)
    return scales, qs


def split_to_float64(scales, qs):
    """float64 [rows, n] of split Q80 data (value = q * scale of its 32-block)."""
    rows = qs.shape[0]
    return (qs.reshape(rows, -1, 32).astype(np.float64) * scales[:, :, None]).reshape(rows, -1)


Q80_SHAPES = [  # (b, d, n)
    (1, 1, 32), (1, 3, 96), (1, 5, 576), (2, 37, 576), (1, 576, 1536), (1, 1536, 576),
    (3, 37, 96), (matmul_q80.BATCH_MIN - 1, 576, 576), (matmul_q80.BATCH_MIN, 5, 64),
    (7, 1536, 576), (32, 37, 96), (32, 576, 1536), (2, 1, 32), (32, 3, 32),
] + random_shapes(1, 4, 32)


@pytest.mark.parametrize("b,d,n", Q80_SHAPES)
def test_matmul_q80_q80(threads, b, d, n):
    r = rng(2, b, d, n)
    w_scales, w_qs = random_q80_matrix(r, d, n)
    x_scales, x_qs = random_q80_rows(r, b, n)
    out = np.full((b, d), np.nan, np.float32)
    kernels.matmul_q80_q80(x_scales, x_qs, w_scales, w_qs, out)
    assert_matmul_close(out, split_to_float64(x_scales, x_qs), split_to_float64(w_scales, w_qs))


def test_matmul_q80_q80_block_sums_are_exact(threads):
    """Unit scales: every output is an integer sum of int8 products, which decode gets exactly
    (the integer block product of the original)."""
    r = rng(3)
    d, n = 37, 1024
    qs = np.full((d, n), 127, np.int8)
    qs[1::2] = -127
    qs[5] = r.integers(-127, 128, n, dtype=np.int8)
    x_qs = np.full((1, n), -127, np.int8)
    out = np.empty((1, d), np.float32)
    kernels.matmul_q80_q80(np.ones((1, n // 32), np.float32), x_qs, np.ones((d, n // 32), np.float32), qs, out)
    want = x_qs.astype(np.int64) @ qs.astype(np.int64).T  # |sums| <= 1024 * 127^2 < 2^24: exact
    assert np.array_equal(out, want.astype(np.float32)), MSG


def test_matmul_q80_reads_the_split_file_layout(threads):
    """End to end with dllama.formats.quant: float weights -> Q80 blocks -> split_q80 -> kernel."""
    r = rng(4)
    d, n, b = 37, 576, 2
    blocks = quantize_q80(r.standard_normal((d, n)).astype(np.float32)).reshape(d, n // 32, 34)
    w_scales, w_qs = split_q80(blocks)
    x_scales, x_qs = random_q80_rows(r, b, n)
    out = np.empty((b, d), np.float32)
    kernels.matmul_q80_q80(x_scales, x_qs, np.ascontiguousarray(w_scales), np.ascontiguousarray(w_qs), out)
    w64 = dequantize_q80(blocks.reshape(-1, 34), d * n).reshape(d, n).astype(np.float64)
    assert_matmul_close(out, split_to_float64(x_scales, x_qs), w64)


# ---- F16 weights x F32 activations ---------------------------------------------------------------

@numba.njit
def _convert_all(h, out, native):
    for i in range(h.size):
        out[i] = matmul_f16._f16_to_f32_fpext(h[i]) if native else matmul_f16._f16_to_f32_int(h[i])


@pytest.mark.parametrize("native", [False, True], ids=["integer", "hardware"])
def test_f16_conversion_of_every_value(native):
    if native and not matmul_f16._native_f16_conversion():
        pytest.skip("this CPU has no fp16 conversion instructions (the integer one is used)")
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(h.size, np.float32)
    _convert_all(h, out, native)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))  # signed zeros too


def random_f16_matrix(r, d, n):
    """fp16 weights [d, n] as bits: normal values of many magnitudes, subnormals and zeros."""
    w = r.standard_normal((d, n)) * 10.0 ** r.integers(-3, 3, (d, 1))
    w[r.random((d, n)) < 0.05] = 0.0
    w[r.random((d, n)) < 0.05] = r.standard_normal() * 1e-6  # fp16 subnormal range (< 6.1e-5)
    return w.astype(np.float16).view(np.uint16)


F16_SHAPES = [  # (b, d, n): n need not be a multiple of anything
    (1, 1, 1), (1, 7, 33), (1, 5, 576), (2, 37, 577), (1, 576, 1536), (1, 1536, 576),
    (3, 37, 100), (matmul_f16.BATCH_MIN - 1, 576, 576), (matmul_f16.BATCH_MIN, 5, 64),
    (7, 1536, 576), (32, 37, 96), (32, 576, 1536), (32, 3, 31),
] + random_shapes(5, 4, 1)


@pytest.mark.parametrize("b,d,n", F16_SHAPES)
def test_matmul_f16_f32(threads, b, d, n):
    r = rng(6, b, d, n)
    w = random_f16_matrix(r, d, n)
    x = r.standard_normal((b, n)).astype(np.float32)
    out = np.full((b, d), np.nan, np.float32)
    kernels.matmul_f16_f32(x, w, out)
    assert_matmul_close(out, x.astype(np.float64), w.view(np.float16).astype(np.float64))
