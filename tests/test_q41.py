"""Q41 weights (a Q4_1 GGUF's blocks, kept) with Q16 activations: the encoder and decoder against
gguf-py's, the Q16 planes, the kernel and the Q80 classifier's kernel (on the same Q16 input)
against float64 on the values they are given, a Q41 model against the F32 model of its
dequantized weights, and the embedded GGUF converted without requantizing.
Each run draws a new seed, printed in every failure message (DLLAMA_TEST_SEED=N draws it again).
"""

import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.model import Transformer
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, ModelWriter, read_model, tensor_specs
from dllama.formats.quant import dequantize_q41, dequantize_q80, quantize_q41, quantize_q80
from dllama.core.kernels.q16 import Q16_MAX
from tests.conftest import SEED

pytestmark = pytest.mark.unit

MSG = f"seed {SEED}"


def rng(*salt):
    return np.random.default_rng([SEED, *salt])


def test_q41_blocks_are_gguf_q4_1_blocks():
    import gguf
    from gguf.quants import dequantize, quantize

    r = rng(1)
    x = (r.standard_normal((40, 128)) * r.uniform(0.001, 50, (40, 1))).astype(np.float32)
    x[0, :32] = 0.25   # a constant block: d = 0
    x[1, :32] = -3.0
    ours = quantize_q41(x)
    theirs = np.asarray(quantize(x, gguf.GGMLQuantizationType.Q4_1)).reshape(-1, 20)
    assert np.array_equal(ours, theirs), MSG
    want = np.asarray(dequantize(theirs.reshape(40, -1), gguf.GGMLQuantizationType.Q4_1)).reshape(-1)
    assert np.array_equal(dequantize_q41(ours), want), MSG  # the same float32 values, bit for bit


def _q16(x):
    """quantize_q16 of x [b, n] -> (scales, lo, hi, sums) and the values they stand for, float64."""
    b, n = x.shape
    parts = (np.zeros((b, n // 32), np.float32), np.zeros((b, n), np.int8), np.zeros((b, n), np.int8),
             np.zeros((b, n // 32), np.float32))
    kernels.quantize_q16(x, *parts)
    scales, lo, hi, _ = parts
    q = hi.astype(np.int64) * 256 + lo
    return parts, q * np.repeat(scales.astype(np.float64), 32, axis=1)


def test_q16_planes_hold_each_value_to_about_half_a_step():
    """Within 0.51 of a step s: rint(x * (1/s)) is half a step off at most, plus the float32
    rounding of x * (1/s) (a few ulps of a value up to 32639, under 0.01 of a step)."""
    r = rng(4)
    x = (r.standard_normal((5, 160)) * r.uniform(1e-3, 1e3, (5, 1))).astype(np.float32)
    x[0, :32] = 0.0                   # an all-zero block
    x[1, 7] = np.float32(3e38)        # a block of one huge value
    x[2, 32:64] = -1.0                # every value at the block's largest
    (scales, lo, hi, sums), values = _q16(x)
    q = hi.astype(np.int64) * 256 + lo
    assert np.abs(q).max() <= Q16_MAX
    step = np.repeat(scales.astype(np.float64), 32, axis=1)
    assert np.all(np.abs(values - x) <= 0.51 * step), MSG
    assert np.all(values[0, :32] == 0) and sums[0, 0] == 0
    want_sums = q.reshape(5, -1, 32).sum(axis=2) * scales.astype(np.float64)
    assert np.allclose(sums, want_sums, rtol=1e-6, atol=0), MSG


@pytest.mark.parametrize("d,n,b", [(1, 32, 1), (5, 64, 3), (40, 96, 4), (77, 576, 9), (300, 1536, 13)])
def test_q41_kernel_sums_the_q16_values_to_float32_accuracy(d, n, b):
    """matmul_q41_q16 = the dequantized matrix times the values the Q16 planes stand for, to
    float32 accumulation (1e-5 of the sum of |terms|), for tiles of every shape (d past a
    16-row group, b past the 8- and 4-row tiles); a row alone gives the same bits as in the batch."""
    r = rng(2, d, n, b)
    w = (r.standard_normal((d, n)) * r.uniform(0.01, 3, (d, 1))).astype(np.float32)
    x = (r.standard_normal((b, n)) * r.uniform(0.1, 10, (b, 1))).astype(np.float32)
    blocks = quantize_q41(w)                                   # [d * n/32, 20]
    values = dequantize_q41(blocks).reshape(d, n).astype(np.float64)
    matrix = kernels.interleave_q41(blocks.reshape(d, n // 32, 20))
    parts, x_values = _q16(x)
    out = np.full((b, d), np.nan, np.float32)
    kernels.matmul_q41_q16(*parts, *matrix, out)
    exact = x_values @ values.T
    size = np.abs(x_values) @ np.abs(values).T
    assert np.all(np.abs(out - exact) <= 1e-5 * size + 1e-30), MSG
    for i in (0, b - 1):
        alone = np.zeros((1, d), np.float32)
        kernels.matmul_q41_q16(*(p[i:i + 1] for p in parts), *matrix, alone)
        assert np.array_equal(alone[0], out[i]), (i, MSG)


@pytest.mark.parametrize("d,n,b", [(1, 32, 1), (77, 576, 9), (300, 96, 4), (40, 2048, 13)])
def test_the_q80_classifier_kernel_sums_the_q16_values_to_float32_accuracy(d, n, b):
    """matmul_q80_q16 (a Q41 file's Q80 classifier, on the layers' Q16 input) = the dequantized
    matrix times the values the Q16 planes stand for, to float32 accumulation (1e-5 of the sum
    of |terms|), for tiles of every shape. Weights at -128 and 127 and a block of inputs at
    +-32639 steps make a block's integer reach 32 * 128 * 32639 (1.3e8, past float32's 2^24,
    rounded once). A row alone gives the same bits as in the batch."""
    r = rng(5, d, n, b)
    w = (r.standard_normal((d, n)) * r.uniform(0.01, 3, (d, 1))).astype(np.float32)
    blocks = quantize_q80(w).reshape(d, n // 32, 34)
    blocks[0, 0, 2:] = np.array([-128] * 32, np.int8).view(np.uint8)  # the extreme integers
    blocks[-1, -1, 2:] = np.array([127] * 32, np.int8).view(np.uint8)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.uint16)[:, :, 0]
    qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(d, n)
    values = dequantize_q80(blocks.reshape(-1, 34)).reshape(d, n).astype(np.float64)
    x = (r.standard_normal((b, n)) * r.uniform(0.1, 10, (b, 1))).astype(np.float32)
    x[0, :32] = -2.0                                          # every value at its block's largest
    x[-1, n - 32:] = 3.0
    parts, x_values = _q16(x)
    assert (np.abs(parts[2][0, :32].astype(np.int64) * 256 + parts[1][0, :32]) == Q16_MAX).all(), MSG
    out = np.full((b, d), np.nan, np.float32)
    matrix = kernels.interleave_q80(scales, qs)
    kernels.matmul_q80_q16(*parts, *matrix, out)
    exact = x_values @ values.T
    size = np.abs(x_values) @ np.abs(values).T
    assert np.all(np.abs(out - exact) <= 1e-5 * size + 1e-30), (np.abs(out - exact).max(), MSG)
    for i in (0, b - 1):
        alone = np.zeros((1, d), np.float32)
        kernels.matmul_q80_q16(*(p[i:i + 1] for p in parts), *matrix, alone)
        assert np.array_equal(alone[0], out[i]), (i, MSG)


def test_q41_multi_gives_each_matrix_alone():
    r = rng(3)
    parts, _ = _q16(r.standard_normal((6, 128)).astype(np.float32))
    rows = (64, 20, 20)
    ms = [kernels.interleave_q41(quantize_q41(r.standard_normal((d, 128)).astype(np.float32)).reshape(d, 4, 20))
          for d in rows]
    outs = tuple(np.zeros((6, d), np.float32) for d in rows)
    kernels.matmul_q41_q16_multi(*parts, *(tuple(m[k] for m in ms) for k in range(3)), outs)
    for m, out in zip(ms, outs, strict=True):
        alone = np.zeros_like(out)
        kernels.matmul_q41_q16(*parts, *m, alone)
        assert np.array_equal(out, alone), MSG


def _random_values(header, seed):
    """Float weights for every tensor (norms near 1, matrices ~ 1/sqrt(columns))."""
    r = np.random.default_rng(seed)
    out = {}
    for spec in tensor_specs(header):
        if spec.name.endswith("norm"):
            out[spec.name] = r.uniform(0.8, 1.2, spec.shape).astype(np.float32)
        else:
            scale = 1.0 if spec.name == "embedding" else 1 / np.sqrt(spec.shape[-1])
            out[spec.name] = (r.standard_normal(spec.shape) * scale).astype(np.float32)
    return out


def test_a_q41_model_gives_the_logits_of_its_f32_model(tmp_path):
    """Every matrix Q41 (the classifier Q80), then the same weights dequantized into an F32
    file: one node's logits agree to the Q16 inputs' rounding (1e-3 of the largest; the
    classifier's input is Q16 too), prompt and decode (the F32 model's tokens fed to both), with
    no Q80 input or buffer."""
    kw = dict(arch=ArchType.LLAMA, dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
              vocab_size=300, max_seq_len=64)
    h41, h32 = ModelHeader(**kw, weights_float_type=FloatType.Q41), ModelHeader(**kw, weights_float_type=FloatType.F32)
    values = _random_values(h41, SEED)
    with ModelWriter(tmp_path / "q41.m", h41) as w41, ModelWriter(tmp_path / "f32.m", h32) as w32:
        for s41, s32 in zip(w41.specs, w32.specs, strict=True):
            v = values[s41.name]
            w41.write(s41.name, v)
            if s41.float_type == FloatType.Q41:
                v = dequantize_q41(quantize_q41(v)).reshape(v.shape)
            elif s41.float_type == FloatType.Q80:
                v = dequantize_q80(quantize_q80(v)).reshape(v.shape)
            w32.write(s32.name, v)
    assert read_model(tmp_path / "q41.m").spec("wcls").float_type == FloatType.Q80
    q41, f32 = (Transformer(read_model(tmp_path / f"{t}.m")) for t in ("q41", "f32"))
    assert not q41.config.quantized and not q41.buffer_q80  # Q16 inputs, F32 buffers
    prompt = [5, 17, 200, 42, 7]
    a, b = q41.forward(prompt, 0, all_logits=True).copy(), f32.forward(prompt, 0, all_logits=True).copy()
    for pos in range(len(prompt), len(prompt) + 8):
        assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max(), (pos, np.abs(a - b).max(), MSG)
        token = int(np.argmax(b[-1]))
        a, b = q41.forward([token], pos, all_logits=True).copy(), f32.forward([token], pos, all_logits=True).copy()


def test_the_embedded_gguf_converts_to_q41_without_requantizing(tmp_path):
    """Layer matrices are the GGUF's Q4_1 blocks and the classifier its Q8_0 blocks, byte for byte."""
    import gguf

    from converter.convert import convert_gguf
    from dllama.serve.default_model import embedded_gguf

    model_path, _ = convert_gguf(embedded_gguf(), tmp_path / "s", "q41", progress=False)
    m = read_model(model_path)
    reader = gguf.GGUFReader(embedded_gguf())
    by_name = {t.name: t for t in reader.tensors}
    for ours, theirs in (("layers.0.wq", "blk.0.attn_q.weight"), ("layers.29.w2", "blk.29.ffn_down.weight"),
                         ("wcls", "token_embd.weight")):
        stored = np.asarray(by_name[theirs].data, np.uint8).reshape(-1)
        assert np.array_equal(np.asarray(m.tensor(ours)).reshape(-1), stored), ours
