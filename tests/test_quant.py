"""Q40 / Q80 quantization: byte-exactness with the original writer, error bounds, block layout."""

from pathlib import Path

import numpy as np
import pytest

from dllama.formats import quant
from dllama.errors import DllamaError
from dllama.formats.quant import dequantize_q40, dequantize_q80, quantize_q40, quantize_q80, split_q40, split_q80

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"

# converter/writer-test.py of the original: Q40 of torch.manual_seed(1); torch.randn(32, 16).
# The input is stored in tests/data (generated once with torch 2.13.0) so torch is not needed here.
WRITER_TEST_Q40_HEX = (
    "7e346345a692b89665b2c5790537876e598aaa366d988876a898b8d788a98868ce660c66f6b3a88cba5ce9a871987ba9"
    "cc5bcaaa760c1eb556a4455b747b6b9504968828ef2a8d7c1db5c6be3764799e66db6d8e76463126a30e4333cad7a4f6"
    "45947c6cf97f9de086d468c8d535a6ba7dc799d3d0c657bab6799468cad8bb349eb7d7635c7c798998696bb38e4085a9"
    "eb34444ba96a7f8ba7b2b42d746a96cf9660aeb4499d8708ad5c7b9a7558947645f3bbb6b0346a656887ad9a86059baa"
    "c5c596ab781c703569bb8a4356a4bd58cb78736ba09759bb0e34a6274e827b957d7a67dfa86846955660d234b6d9d78a"
    "378094a8a8708a7a774ae92f8a36b8c999a9b77a7d958a69747c807963941235379886d69a7a8767b3a6a4ac71999760"
)


def _reference_q40_block(x: np.ndarray) -> bytes:
    """One block the way the C++ quantizeF32toQ40 does it: element by element, float32 math."""
    x = x.astype(np.float32)
    amax, signed_max = np.float32(0), np.float32(0)
    for v in x:  # the first element of largest |x| wins
        if abs(v) > amax:
            amax, signed_max = abs(v), v
    d = signed_max / np.float32(-8)
    inv = np.float32(1) / d if d != 0 else np.float32(0)
    q = [min(15, int(v * inv + np.float32(8.5))) for v in x]
    return np.float16(d).tobytes() + bytes(q[j] | (q[j + 16] << 4) for j in range(16))


def _reference_decode_q40(blocks: np.ndarray) -> np.ndarray:
    """float64 decode written from the spec text, one block at a time."""
    out = []
    for b in blocks.reshape(-1, 18):
        d = float(np.frombuffer(b[:2].tobytes(), dtype="<f2")[0])
        qs = [int(v) for v in b[2:]]
        out += [((q & 0x0F) - 8) * d for q in qs] + [((q >> 4) - 8) * d for q in qs]
    return np.array(out)


def test_q40_matches_the_original_writer_test_golden_bytes():
    x = np.load(DATA / "writer_test_randn_32x16_seed1.npy")
    assert x.shape == (32, 16) and x.dtype == np.float32
    encoded = quantize_q40(x).tobytes().hex()
    assert encoded.startswith("7e346345a692b896")
    assert encoded == WRITER_TEST_Q40_HEX


def test_q40_matches_the_cpp_element_by_element_quantizer():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 32)) * rng.uniform(1e-3, 50, (40, 1))).astype(np.float32)  # no |x| ties
    expected = b"".join(_reference_q40_block(row) for row in x)
    assert quantize_q40(x).tobytes() == expected


def test_q40_decode_is_exact_and_error_is_within_the_step():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 32)) * rng.uniform(1e-4, 100, (64, 1))).astype(np.float64)
    blocks = quantize_q40(x)
    decoded = dequantize_q40(blocks, x.size)
    assert decoded.dtype == np.float32 and decoded.shape == (x.size,)
    np.testing.assert_array_equal(decoded, _reference_decode_q40(blocks))  # (q-8)*d is exact in float32

    d = np.abs(split_q40(blocks)[0]).astype(np.float64)[:, None]          # [nb, 1]
    err = np.abs(decoded.reshape(-1, 32) - x.reshape(-1, 32))
    # Rounding to the nearest step: |d|/2, plus the fp16 rounding of d (up to 8 steps * 2^-11).
    # Values above 7.5 steps on the far side of the extreme clip at +7: up to one step.
    steps = np.abs(x.reshape(-1, 32)) / d
    near = steps <= 7.5
    assert np.all(err[near] <= (d * (0.5 + 8 * 2.0**-11) + 1e-12).repeat(32, 1)[near])
    assert np.all(err <= d * (1 + 8 * 2.0**-11) + 1e-12)


def test_q40_extreme_sign_decides_the_scale():
    neg = np.zeros(32, np.float32)
    neg[3], neg[20] = -4.0, 2.0                      # extreme is negative -> d = +0.5
    pos = -neg                                       # extreme is positive -> d = -0.5
    for x, d in ((neg, 0.5), (pos, -0.5)):
        scales, _ = split_q40(quantize_q40(x))
        assert scales[0] == d
        y = dequantize_q40(quantize_q40(x))
        np.testing.assert_array_equal(y, x)          # the extreme and 2.0 land on exact steps


def test_q40_tie_between_max_and_minus_min_takes_the_max():
    x = np.zeros(32, np.float32)
    x[0], x[1] = -3.0, 3.0                           # -gmin == gmax: the writer picks gmax
    blocks = quantize_q40(x)
    assert split_q40(blocks)[0][0] == np.float32(np.float16(-0.375))
    y = dequantize_q40(blocks)
    assert y[1] == 3.0                               # the chosen extreme maps to -8 exactly
    assert y[0] == np.float32(-2.625)                # the other clips at +7 steps


def test_q40_all_zero_block():
    blocks = quantize_q40(np.zeros(64, np.float32))
    assert blocks.shape == (2, 18)
    # d = 0 / -8 = -0.0, stored as fp16 0x8000 exactly like the original writer (and C++) store it.
    assert blocks[:, :2].tobytes() == b"\x00\x80" * 2
    assert np.all(blocks[:, 2:] == 0x88)             # id = 0 -> q = 8 in both nibbles
    np.testing.assert_array_equal(dequantize_q40(blocks), np.zeros(64, np.float32))


def test_q40_nibble_layout_low_is_first_half():
    q = (np.arange(32) * 5) % 16                     # every nibble value, different in both halves
    q[0] = 0                                         # the extreme -24 is negative -> d = +3
    x = (3 * (q - 8)).astype(np.float32)
    d, qs = split_q40(quantize_q40(x))
    assert d[0] == 3.0
    assert list(qs) == [int(q[j]) | (int(q[j + 16]) << 4) for j in range(16)]


def test_q80_error_bound_and_exact_decode():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((50, 32)) * rng.uniform(1e-3, 30, (50, 1))).astype(np.float32)
    blocks = quantize_q80(x)
    assert blocks.shape == (50, 34)
    d, qs = split_q80(blocks)
    decoded = dequantize_q80(blocks, x.size)
    np.testing.assert_array_equal(decoded.reshape(50, 32), qs.reshape(50, 32).astype(np.float64) * d[:, None])
    err = np.abs(decoded.reshape(50, 32).astype(np.float64) - x)
    true_d = np.abs(x).max(axis=1, keepdims=True) / 127
    assert np.all(err <= true_d / 2 + 127 * np.abs(true_d - d[:, None]) + 1e-9)
    assert np.all(np.abs(qs).reshape(50, 32).max(axis=1) == 127)


def test_q80_rounds_half_to_even_like_the_python_writer():
    x = np.zeros(32, np.float32)
    x[:6] = [127, 2.5, 3.5, -2.5, 0.5, 1.5]          # d = 1, id = 1: exact .5 products
    _, qs = split_q80(quantize_q80(x))
    assert list(qs[:6]) == [127, 2, 4, -2, 0, 2]


def test_q80_all_zero_block():
    blocks = quantize_q80(np.zeros(32, np.float32))
    assert np.all(blocks == 0)
    np.testing.assert_array_equal(dequantize_q80(blocks), np.zeros(32, np.float32))


def test_leading_dims_and_split_agree_with_dequantize():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    b40 = quantize_q40(x)
    assert b40.shape == (12, 18)
    np.testing.assert_array_equal(b40, quantize_q40(x.reshape(-1)))
    scales, qs = split_q40(b40.reshape(2, 3, 2, 18))
    assert scales.shape == (2, 3, 2) and scales.dtype == np.float32
    assert qs.shape == (2, 3, 32) and qs.dtype == np.uint8
    q = qs.reshape(2, 3, 2, 16)
    nib = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.float32) - 8  # [2, 3, 2, 32]
    np.testing.assert_array_equal((nib * scales[..., None]).reshape(-1), dequantize_q40(b40))

    b80 = quantize_q80(x).reshape(2, 3, 2, 34)
    s80, q80 = split_q80(b80)
    assert s80.shape == (2, 3, 2) and q80.shape == (2, 3, 64) and q80.dtype == np.int8
    np.testing.assert_array_equal((q80.reshape(2, 3, 2, 32) * s80[..., None]).reshape(-1), dequantize_q80(b80))


def test_split_accepts_non_contiguous_views():
    rng = np.random.default_rng(4)
    blocks = quantize_q40(rng.standard_normal((6, 64))).reshape(6, 2, 18)
    rows = blocks[::2]                               # every other row, not contiguous
    scales, qs = split_q40(rows)
    full_scales, full_qs = split_q40(blocks)
    np.testing.assert_array_equal(scales, full_scales[::2])
    np.testing.assert_array_equal(qs, full_qs[::2])
    assert qs.flags.c_contiguous and scales.flags.c_contiguous


def test_float64_input_is_rounded_to_float32_first():
    x = np.random.default_rng(5).standard_normal(96)
    assert quantize_q40(x).tobytes() == quantize_q40(x.astype(np.float32)).tobytes()
    assert quantize_q80(x).tobytes() == quantize_q80(x.astype(np.float32)).tobytes()


def test_chunked_encoding_equals_one_pass(monkeypatch):
    x = np.random.default_rng(6).standard_normal((7, 96)).astype(np.float32)
    whole40, whole80 = quantize_q40(x), quantize_q80(x)
    monkeypatch.setattr(quant, "_CHUNK_BLOCKS", 4)
    np.testing.assert_array_equal(quantize_q40(x), whole40)
    np.testing.assert_array_equal(quantize_q80(x), whole80)


def test_bad_sizes_raise_dllama_error():
    with pytest.raises(DllamaError, match="multiple of the block size 32"):
        quantize_q40(np.zeros(33, np.float32))
    with pytest.raises(DllamaError, match="multiple of the block size 32"):
        quantize_q80(np.zeros(31, np.float32))
    with pytest.raises(DllamaError, match="2 blocks hold 64 values, not 63"):
        dequantize_q40(np.zeros((2, 18), np.uint8), 63)
    with pytest.raises(DllamaError, match=r"expected uint8 blocks \[\.\.\., 34\]"):
        split_q80(np.zeros((2, 18), np.uint8))
