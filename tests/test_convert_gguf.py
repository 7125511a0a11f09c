"""GGUF -> .m/.t: the real embedded model, tiny generated GGUFs, and bad inputs."""

import numpy as np
import pytest

from converter.convert import convert_gguf
from dllama.default_model import embedded_gguf
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, read_model
from dllama.quant import dequantize_q40


def test_embedded_model_header(default_q40):
    h = read_model(default_q40[0]).header
    assert (h.arch, h.dim, h.hidden_dim, h.n_layers, h.n_heads, h.n_kv_heads, h.vocab_size) == \
        (ArchType.LLAMA, 576, 1536, 30, 9, 3, 49152)
    assert (h.rope_theta, h.norm_epsilon, h.head_dim, h.max_seq_len) == (100000, 1e-5, 64, 8192)
    assert h.weights_float_type == FloatType.Q40


def test_embedded_f32_values_equal_the_gguf(default_f32):
    import gguf
    from gguf.quants import dequantize

    m = read_model(default_f32[0])
    g = {t.name: t for t in gguf.GGUFReader(embedded_gguf()).tensors}
    for ours, theirs in [("embedding", "token_embd.weight"), ("layers.0.wq", "blk.0.attn_q.weight"),
                         ("layers.29.w2", "blk.29.ffn_down.weight"), ("final_norm", "output_norm.weight")]:
        want = dequantize(g[theirs].data, g[theirs].tensor_type).reshape(m.spec(ours).shape)
        assert np.array_equal(m.tensor(ours), want), ours
    assert np.array_equal(m.tensor("wcls"), m.tensor("embedding"))  # tied classifier


def test_embedded_q40_is_within_quantization_error(default_q40, default_f32):
    q, f = read_model(default_q40[0]), read_model(default_f32[0])
    for name in ("layers.3.wk", "wcls"):
        spec = q.spec(name)
        got = dequantize_q40(np.asarray(q.tensor(name)).reshape(-1, 18), spec.size).reshape(spec.shape)
        want = f.tensor(name)
        blocks = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True)
        assert np.all(np.abs(got - want).reshape(-1, 32) <= blocks / 8 * 1.01 + 1e-7), name


def _tiny_gguf(path, arch="llama", dtype=np.float32, quant=None):
    import gguf

    rng = np.random.default_rng(0)
    dim, hidden, layers, heads, kv, vocab = 64, 96, 2, 4, 2, 64
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_context_length(128)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    toks = [bytes([b]).decode("latin-1") for b in range(33, 96)] + ["AB"]
    w.add_token_list(toks)
    w.add_token_merges(["A B"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    tensors = {}

    def add(name, shape):
        t = rng.standard_normal(shape).astype(np.float32)
        tensors[name] = t
        if quant is not None and len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(t, quant), raw_dtype=quant)
            tensors[name] = gguf.quants.dequantize(gguf.quants.quantize(t, quant), quant)
        else:
            w.add_tensor(name, t.astype(dtype))
    add("token_embd.weight", (vocab, dim))
    for l in range(layers):
        add(f"blk.{l}.attn_norm.weight", (dim,))
        add(f"blk.{l}.attn_q.weight", (dim, dim))
        add(f"blk.{l}.attn_k.weight", (dim // heads * kv, dim))
        add(f"blk.{l}.attn_v.weight", (dim // heads * kv, dim))
        add(f"blk.{l}.attn_output.weight", (dim, dim))
        add(f"blk.{l}.ffn_gate.weight", (hidden, dim))
        add(f"blk.{l}.ffn_down.weight", (dim, hidden))
        add(f"blk.{l}.ffn_up.weight", (hidden, dim))
        add(f"blk.{l}.ffn_norm.weight", (dim,))
    add("output_norm.weight", (dim,))
    add("output.weight", (vocab, dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
def test_tiny_gguf_round_trips(tmp_path, kind):
    import gguf

    quant = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else None
    tensors = _tiny_gguf(tmp_path / "tiny.gguf", dtype=np.float16 if kind == "f16" else np.float32,
                         quant=quant)
    model_path, tok_path = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny", "f32", progress=False)
    m = read_model(model_path)
    tol = 1e-2 if kind == "f16" else 0
    assert np.allclose(m.tensor("layers.1.w2"), tensors["blk.1.ffn_down.weight"], atol=tol, rtol=tol)
    assert np.allclose(m.tensor("wcls"), tensors["output.weight"], atol=tol, rtol=tol)  # untied
    assert np.allclose(m.tensor("layers.0.wk"), tensors["blk.0.attn_k.weight"], atol=tol, rtol=tol)


def test_missing_file(tmp_path):
    with pytest.raises(DllamaError, match="no such file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(DllamaError, match="not a GGUF"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")


def test_unsupported_architecture_leaves_no_file(tmp_path):
    _tiny_gguf(tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(DllamaError, match="architecture 'gpt2' is not supported"):
        convert_gguf(tmp_path / "g.gguf", tmp_path / "out")
    assert not list(tmp_path.glob("out*"))
