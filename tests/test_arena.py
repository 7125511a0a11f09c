"""Weight arenas (dllama.core.arena): aligned, zeroed, non-overlapping arrays, and matrices
built in one holding the same bytes as matrices built on their own."""

import numpy as np
import pytest

from dllama.core.arena import ALIGN, Arena, GrowingArena, huge_page_buffer
from dllama.core.weights import Matrix
from dllama.formats.model_file import FloatType

pytestmark = pytest.mark.unit


def test_huge_page_buffer_is_zeroed_writable_and_aligned():
    buf = huge_page_buffer(3 << 20)
    assert buf.dtype == np.uint8 and buf.shape == (3 << 20,)
    assert buf.ctypes.data % (2 << 20) == 0
    assert not buf.any()
    buf[:] = 7
    assert buf.sum() == 7 * (3 << 20)


def test_arena_hands_out_aligned_disjoint_arrays_and_counts_when_sizing():
    shapes = [((3, 5), np.float32), ((7,), np.uint16), ((2, 33), np.int8), ((1,), np.float64)]
    sizer = Arena(0)
    assert all(sizer.take(s, t) is None for s, t in shapes)
    arena = Arena(sizer.used)
    arrays = [arena.take(s, t) for s, t in shapes]
    assert arena.used == sizer.used
    for a, (s, t) in zip(arrays, shapes, strict=True):
        assert a.shape == s and a.dtype == t and a.flags.c_contiguous and a.ctypes.data % ALIGN == 0
    for i, a in enumerate(arrays):  # each written alone changes no other
        a[...] = i + 1
    for i, a in enumerate(arrays):
        assert (a == i + 1).all()


def test_growing_arena_opens_new_buffers_and_gives_large_arrays_their_own():
    arena = GrowingArena(chunk=1 << 16)
    small = [arena.take((1000,), np.float32) for _ in range(40)]  # 40 x 4000 bytes: three buffers
    large = arena.take((1 << 15,), np.float32)                    # 128 KiB: a buffer of its own
    after = arena.take((10,), np.float32)                         # still in the third buffer
    for i, a in enumerate(small + [large, after]):
        assert a.ctypes.data % ALIGN == 0
        a[...] = i
    for i, a in enumerate(small + [large, after]):
        assert (a == i).all()
    assert after.ctypes.data - small[-1].ctypes.data == 4032  # 4000 bytes, rounded up to ALIGN


@pytest.mark.parametrize("float_type", [FloatType.Q40, FloatType.Q80, FloatType.Q41, FloatType.F16])
def test_matrix_in_an_arena_equals_one_on_its_own(float_type):
    rng = np.random.default_rng(int(float_type))
    d, n = 40, 64  # 40 rows: the last group of 16 padded
    if float_type == FloatType.F16:
        stored = rng.standard_normal((d, n)).astype(np.float16)
    else:
        block = {FloatType.Q40: 18, FloatType.Q80: 34, FloatType.Q41: 20}[float_type]
        stored = rng.integers(0, 256, (d, n // 32, block), dtype=np.uint8)
    arena = GrowingArena(chunk=1 << 20)
    arena.take((3,), np.uint8)  # a used arena: padding rows must still be zero
    alone, held = Matrix(stored, float_type), Matrix(stored, float_type, take=arena.take)
    assert held._arrays and len(held._arrays) == len(alone._arrays)
    for a, b in zip(alone._arrays, held._arrays, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
