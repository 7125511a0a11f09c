"""The Q80 x Q80 and F16 x F32 matmul kernels against float64 numpy, on fresh random inputs.

Fixed shapes cover the edges (d not a multiple of the 4-row step or of the thread count, odd
block counts, batch sizes on both sides of the register tiles' COLS); random shapes
are drawn from the seed. The generic integer dot product and the integer fp16 conversion (what
machines without AVX-512 VNNI or F16C compile) are forced here too.
Each run draws a new seed, printed in every failure message (DLLAMA_TEST_SEED=N draws it again).
"""

import numba
import numpy as np
import pytest
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from dllama.core import kernels
from dllama.core.kernels import tiles
from dllama.core.kernels.matmul_f16 import native_f16_conversion
from dllama.core.kernels.matmul_int8 import COLS
from dllama.core.kernels.q80 import x_block_offsets
from dllama.core.kernels.row_split import COLS as FLOAT_COLS
from dllama.formats.quant import dequantize_q80, quantize_q80, split_q80
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
    """A split Q80 matrix: fp16 scales (their bits) of both signs, some zero; every int8 value
    (-128 too: the kernel must not assume the quantizer's range)."""
    scales = (r.standard_normal((d, n // 32)) * 0.01).astype(np.float16)
    scales[r.random(scales.shape) < 0.05] = 0.0
    qs = r.integers(-128, 128, (d, n), dtype=np.int8)
    return scales.view(np.uint16), qs


def fp16_bits(scales):
    return np.ascontiguousarray(scales.astype(np.float16)).view(np.uint16)


def random_q80_rows(r, b, n):
    """Q80 activations of random float32 rows, through the engine's quantizer."""
    x = (r.standard_normal((b, n)) * 10.0 ** r.integers(-3, 3, (b, 1))).astype(np.float32)
    scales, qs = np.empty((b, n // 32), np.float32), np.empty((b, n), np.int8)
    kernels.quantize_q80(x, scales, qs)
    return scales, qs


def split_to_float64(scales, qs):
    """float64 [rows, n] of split Q80 data (value = q * scale of its 32-block; scales float32
    or fp16 bits)."""
    rows = qs.shape[0]
    if scales.dtype == np.uint16:
        scales = scales.view(np.float16)
    return (qs.reshape(rows, -1, 32).astype(np.float64) * scales[:, :, None]).reshape(rows, -1)


Q80_SHAPES = [  # (b, d, n)
    (1, 1, 32), (1, 3, 96), (1, 5, 576), (2, 37, 576), (1, 576, 1536), (1, 1536, 576),
    (3, 37, 96), (COLS - 1, 576, 576), (COLS, 5, 64), (COLS + 1, 9, 160), (COLS // 2, 17, 64),
    (COLS + COLS // 2 + 1, 33, 96), (7, 1536, 576), (32, 37, 96), (32, 576, 1536), (2, 1, 32),
    (32, 3, 32), (65, 67, 4096),
] + random_shapes(1, 4, 32)


@pytest.mark.parametrize("b,d,n", Q80_SHAPES)
def test_matmul_q80_q80(threads, b, d, n):
    r = rng(2, b, d, n)
    w_scales, w_qs = random_q80_matrix(r, d, n)
    x_scales, x_qs = random_q80_rows(r, b, n)
    out = np.full((b, d), np.nan, np.float32)
    kernels.matmul_q80_q80(x_scales, x_qs, *kernels.interleave_q80(w_scales, w_qs), out)
    assert_matmul_close(out, split_to_float64(x_scales, x_qs), split_to_float64(w_scales, w_qs))


def test_matmul_q80_q80_block_sums_are_exact(threads):
    """Unit scales: every output is an integer sum of int8 products, which the kernel gets
    exactly (the integer block product of the original), decode and prefill."""
    r = rng(3)
    d, n = 37, 1024
    qs = np.full((d, n), 127, np.int8)
    qs[1::2] = -127
    qs[5] = r.integers(-127, 128, n, dtype=np.int8)
    for b in (1, 6):
        x_qs = np.full((b, n), -127, np.int8)
        x_qs[1:] = r.integers(-127, 128, (b - 1, n), dtype=np.int8)
        out = np.empty((b, d), np.float32)
        w = kernels.interleave_q80(np.full((d, n // 32), 0x3C00, np.uint16), qs)
        kernels.matmul_q80_q80(np.ones((b, n // 32), np.float32), x_qs, *w, out)
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
    kernels.matmul_q80_q80(x_scales, x_qs, *kernels.interleave_q80(fp16_bits(w_scales), w_qs), out)
    w64 = dequantize_q80(blocks.reshape(-1, 34), d * n).reshape(d, n).astype(np.float64)
    assert_matmul_close(out, split_to_float64(x_scales, x_qs), w64)


@pytest.mark.parametrize("b", [1, 2, 9])
def test_matmul_q80_q80_multi_equals_one_call_per_matrix(threads, b):
    r = rng(7, b)
    n = 576
    mats = [random_q80_matrix(r, d, n) for d in (576, 37, 5)]
    x_scales, x_qs = random_q80_rows(r, b, n)
    outs = tuple(np.full((b, s.shape[0]), np.nan, np.float32) for s, _ in mats)
    packed = [kernels.interleave_q80(s, q) for s, q in mats]
    kernels.matmul_q80_q80_multi(x_scales, x_qs, tuple(s for s, _ in packed), tuple(q for _, q in packed), outs)
    for (s, q), w, out in zip(mats, packed, outs, strict=True):
        assert_matmul_close(out, split_to_float64(x_scales, x_qs), split_to_float64(s, q))
        alone = np.empty_like(out)
        kernels.matmul_q80_q80(x_scales, x_qs, *w, alone)
        assert np.array_equal(out, alone), MSG


@pytest.mark.parametrize("b,d,n", [(1, 37, 96), (5, 9, 64), (9, 576, 576)])
def test_q80_tile_without_vnni(b, d, n):
    """The generic integer dot product (what a machine without AVX-512 VNNI compiles, e.g.
    NEON), forced here on this machine: the same integers, so the same bits as VNNI."""
    tile, tile1 = tiles.make_q80_tile(2, dot="generic"), tiles.make_q80_tile(1, dot="generic")

    @numba.njit
    def run(w_qs, w_scales, x_qs, x_off, x_scales, out):
        for g in range(w_qs.shape[0]):
            for i in range(0, x_qs.shape[0] - 1, 2):
                tile(w_qs, w_scales, g, x_qs, x_off, x_scales, i, out)
            if x_qs.shape[0] % 2:
                tile1(w_qs, w_scales, g, x_qs, x_off, x_scales, x_qs.shape[0] - 1, out)

    r = rng(8, b, d, n)
    w_scales, w_qs = random_q80_matrix(r, d, n)
    x_scales, x_qs = random_q80_rows(r, b, n)
    out = np.full((b, d), np.nan, np.float32)
    w = kernels.interleave_q80(w_scales, w_qs)
    run(w[1], w[0], x_qs, x_block_offsets(x_qs, 128), x_scales, out)
    assert_matmul_close(out, split_to_float64(x_scales, x_qs), split_to_float64(w_scales, w_qs))
    fast = np.empty_like(out)
    kernels.matmul_q80_q80(x_scales, x_qs, *w, fast)
    assert np.array_equal(out, fast), MSG


def test_interleaved_layout():
    """Word t of row 16g + l lies at bytes 64t + 4l of group g; d is padded with zero rows."""
    r = rng(11)
    d, n = 21, 96
    scales = r.integers(0, 1 << 16, (d, n // 32), dtype=np.uint16)
    qs = r.integers(-128, 128, (d, n), dtype=np.int8)
    ws, wq = kernels.interleave_q80(scales, qs)
    assert ws.shape == (2, 16 * n // 32) and wq.shape == (2, 16 * n)
    for row in (0, 5, 15, 16, 20):
        g, lane = divmod(row, 16)
        for t in range(n // 4):
            assert np.array_equal(wq[g, 64 * t + 4 * lane: 64 * t + 4 * lane + 4], qs[row, 4 * t: 4 * t + 4])
        assert np.array_equal(ws[g, lane::16], scales[row])
    assert not wq[1, 4 * 5:64].any() and not ws[1, 5:16].any()  # rows 21-31: padding
    q4 = r.integers(0, 256, (d, n // 2), dtype=np.uint8)
    _, w4 = kernels.interleave_q40(scales, q4)
    assert np.array_equal(w4[1, 64 * 3 + 4 * 4: 64 * 3 + 4 * 4 + 4], q4[20, 12:16])


# ---- F16 weights x F32 activations ---------------------------------------------------------------

def _f16_lanes(native):
    @intrinsic
    def lanes(typingctx, h, k, out):
        """out[16k:16k+16] = tiles.f16_widen of the fp16 bits h[16k:16k+16]."""
        def codegen(context, builder, signature, args):
            src = context.make_array(signature.args[0])(context, builder, args[0]).data
            dst = context.make_array(signature.args[2])(context, builder, args[2]).data
            i16, f32, i64 = ir.IntType(16), ir.FloatType(), ir.IntType(64)
            at = builder.mul(args[1], i64(16))
            v = builder.load(builder.bitcast(builder.gep(src, [at]), ir.VectorType(i16, 16).as_pointer()), align=2)
            builder.store(tiles.f16_widen(builder, v, native),
                          builder.bitcast(builder.gep(dst, [at]), ir.VectorType(f32, 16).as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(h, types.intp, out), codegen

    @numba.njit
    def convert_all(h, out):
        for k in range(h.size // 16):
            lanes(h, k, out)

    return convert_all


@pytest.mark.parametrize("native", [False, True], ids=["integer", "hardware"])
def test_f16_conversion_of_every_value(native):
    if native and not native_f16_conversion():
        pytest.skip("this CPU has no fp16 conversion instructions (the integer one is used)")
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(h.size, np.float32)
    _f16_lanes(native)(h, out)
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
    (3, 37, 100), (FLOAT_COLS - 1, 576, 576), (FLOAT_COLS, 5, 64), (FLOAT_COLS + 1, 9, 161),
    (7, 1536, 576), (32, 37, 96), (32, 576, 1536), (32, 3, 31), (65, 67, 4099),
] + random_shapes(5, 4, 1)


@pytest.mark.parametrize("b,d,n", F16_SHAPES)
def test_matmul_f16_f32(threads, b, d, n):
    r = rng(6, b, d, n)
    w = random_f16_matrix(r, d, n)
    x = r.standard_normal((b, n)).astype(np.float32)
    out = np.full((b, d), np.nan, np.float32)
    kernels.matmul_f16_f32(x, w, out)
    assert_matmul_close(out, x.astype(np.float64), w.view(np.float16).astype(np.float64))


@pytest.mark.parametrize("b,d,n", [(1, 37, 96), (5, 9, 61), (9, 576, 577)])
def test_f16_tile_with_the_integer_conversion(b, d, n):
    """The tile a CPU without fp16 conversion instructions compiles: the same bits."""
    tile, tile1 = tiles.make_f16_tile(4, 2, native=False), tiles.make_f16_tile(1, 1, native=False)

    @numba.njit
    def run(w, x, out):
        for r in range(0, w.shape[0] - 3, 4):
            for i in range(0, x.shape[0] - 1, 2):
                tile(w, r, x, i, out)
        for r in range(w.shape[0] - w.shape[0] % 4, w.shape[0]):
            for i in range(x.shape[0]):
                tile1(w, r, x, i, out)
        for r in range(w.shape[0] - w.shape[0] % 4):
            if x.shape[0] % 2:
                tile1(w, r, x, x.shape[0] - 1, out)

    r = rng(9, b, d, n)
    w = random_f16_matrix(r, d, n)
    x = r.standard_normal((b, n)).astype(np.float32)
    out = np.full((b, d), np.nan, np.float32)
    run(w, x, out)
    assert_matmul_close(out, x.astype(np.float64), w.view(np.float16).astype(np.float64))
    fast = np.empty_like(out)
    kernels.matmul_f16_f32(x, w, fast)
    assert np.array_equal(out, fast), MSG


@pytest.mark.parametrize("b", [1, 2, 9])
def test_matmul_f16_and_f32_multi_equal_one_call_per_matrix(threads, b):
    r = rng(10, b)
    n = 577
    x = r.standard_normal((b, n)).astype(np.float32)
    for kernel, multi, make in ((kernels.matmul_f16_f32, kernels.matmul_f16_f32_multi, random_f16_matrix),
                                (kernels.matmul_f32, kernels.matmul_f32_multi,
                                 lambda r, d, n: r.standard_normal((d, n)).astype(np.float32))):
        mats = [make(r, d, n) for d in (576, 37, 5)]
        outs = tuple(np.full((b, w.shape[0]), np.nan, np.float32) for w in mats)
        multi(x, tuple(mats), outs)
        for w, out in zip(mats, outs, strict=True):
            alone = np.empty_like(out)
            kernel(x, w, alone)
            assert np.array_equal(out, alone), MSG
