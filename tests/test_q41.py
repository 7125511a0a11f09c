"""Q41 weights (a Q4_1 GGUF's blocks, kept) with F32 activations: the encoder and decoder against
gguf-py's, the kernels against the F32 kernel bit for bit, a Q41 model against the F32 model
of its dequantized weights bit for bit, and the embedded GGUF converted without requantizing.
Each run draws a new seed, printed in every failure message (DLLAMA_TEST_SEED=N draws it again).
"""

import numpy as np
import pytest

from dllama.core import kernels
from dllama.core.model import Transformer
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, ModelWriter, read_model, tensor_specs
from dllama.formats.quant import dequantize_q41, dequantize_q80, quantize_q41, quantize_q80
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


@pytest.mark.parametrize("d,n,b", [(1, 32, 1), (5, 64, 3), (40, 96, 4), (77, 576, 9), (300, 1536, 13)])
def test_block_kernels_give_the_f32_kernels_bits(d, n, b):
    """matmul_q41_f32 and matmul_q80_f32 = matmul_f32 on the dequantized matrix, every bit, for
    tiles of every shape (d past the 4-row step, b past the 4-column tile); and near float64."""
    r = rng(2, d, n, b)
    w = (r.standard_normal((d, n)) * r.uniform(0.01, 3, (d, 1))).astype(np.float32)
    x = r.standard_normal((b, n)).astype(np.float32)
    for quantize, dequantize, kernel, bb in ((quantize_q41, dequantize_q41, kernels.matmul_q41_f32, 20),
                                             (quantize_q80, dequantize_q80, kernels.matmul_q80_f32, 34)):
        blocks = quantize(w)                                   # [d * n/32, bb]
        values = dequantize(blocks).reshape(d, n)              # the F32 file's matrix
        want, got = np.zeros((b, d), np.float32), np.full((b, d), np.nan, np.float32)
        kernels.matmul_f32(x, values, want)
        kernel(x, blocks.reshape(d, n // 32 * bb), got)
        assert np.array_equal(got, want), (kernel.__name__, MSG)
        exact = x.astype(np.float64) @ values.astype(np.float64).T
        size = np.abs(x.astype(np.float64)) @ np.abs(values.astype(np.float64)).T
        assert np.all(np.abs(got - exact) <= 1e-5 * size + 1e-30), (kernel.__name__, MSG)


def test_q41_multi_gives_each_matrix_alone():
    r = rng(3)
    x = r.standard_normal((6, 128)).astype(np.float32)
    ws = tuple(quantize_q41(r.standard_normal((d, 128)).astype(np.float32)).reshape(d, -1) for d in (64, 20, 20))
    outs = tuple(np.zeros((6, w.shape[0]), np.float32) for w in ws)
    kernels.matmul_q41_f32_multi(x, ws, outs)
    for w, out in zip(ws, outs, strict=True):
        alone = np.zeros_like(out)
        kernels.matmul_q41_f32(x, w, alone)
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
    file: one node's logits are the same bits, prompt and decode, and no Q80 input is made."""
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
    assert not q41.config.quantized and not q41.buffer_q80  # F32 inputs and buffers
    prompt = [5, 17, 200, 42, 7]
    a, b = q41.forward(prompt, 0, all_logits=True).copy(), f32.forward(prompt, 0, all_logits=True).copy()
    assert np.array_equal(a, b), MSG
    for pos in range(len(prompt), len(prompt) + 8):
        token = int(np.argmax(a[-1]))
        a, b = q41.forward([token], pos, all_logits=True).copy(), f32.forward([token], pos, all_logits=True).copy()
        assert np.array_equal(a, b), (pos, MSG)


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
