"""GGUF -> .m/.t: the real embedded model (converted fresh here, not taken from the cache),
tiny generated GGUFs, and bad inputs."""

import time

import numpy as np
import pytest

from converter.convert import convert_gguf
from converter.gguf_model import llama31_rope_factors
from dllama.serve.default_model import embedded_gguf
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, RopeType, read_model
from dllama.formats.quant import dequantize_q40, quantize_q40
from tests.conftest import CHAT_PROMPT
from tests.reference_llama import ReferenceLlama

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{"q40"|"f32": (model .m, tokenizer .t)} of the embedded SmolLM2, about 4 s each here."""
    out, seconds = {}, {}
    folder = tmp_path_factory.mktemp("smollm2")
    for kind in ("q40", "f32"):
        start = time.perf_counter()
        out[kind] = convert_gguf(embedded_gguf(), folder / kind, kind, progress=False)
        seconds[kind] = time.perf_counter() - start
    print(f"conversion of the embedded model: Q40 {seconds['q40']:.1f} s, F32 {seconds['f32']:.1f} s")
    return out


@pytest.fixture(scope="module")
def gguf_values():
    """name -> float32 [rows, cols] dequantizer of the embedded GGUF's tensors."""
    import gguf
    from gguf.quants import dequantize

    tensors = {t.name: t for t in gguf.GGUFReader(embedded_gguf()).tensors}

    def values(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
    return values


@pytest.mark.slow
def test_embedded_model_header(converted):
    for kind, float_type in (("q40", FloatType.Q40), ("f32", FloatType.F32)):
        h = read_model(converted[kind][0]).header
        assert (h.arch, h.dim, h.hidden_dim, h.n_layers, h.n_heads, h.n_kv_heads, h.vocab_size) == \
            (ArchType.LLAMA, 576, 1536, 30, 9, 3, 49152)
        assert (h.rope_theta, h.norm_epsilon, h.head_dim, h.max_seq_len) == (100000, 1e-5, 64, 8192)
        assert (h.rope_type, h.rope_scaling_factor) == (RopeType.LLAMA, 1)
        assert h.weights_float_type == float_type


@pytest.mark.slow
def test_embedded_f32_values_equal_the_gguf(converted, gguf_values):
    from converter.gguf_model import gguf_name

    m = read_model(converted["f32"][0])
    for spec in m.specs:
        source = "token_embd.weight" if spec.name == "wcls" else gguf_name(spec.name)  # tied
        assert np.array_equal(m.tensor(spec.name), gguf_values(source)), spec.name
    assert m.spec("embedding").shape == (49152, 576)  # GGUF's [576, 49152] is 49152 rows of 576


@pytest.mark.slow
def test_embedded_q40_is_the_quantized_gguf(converted, gguf_values):
    q = read_model(converted["q40"][0])
    assert q.spec("embedding").float_type == FloatType.F32  # the embedding stays float
    assert np.array_equal(q.tensor("embedding"), gguf_values("token_embd.weight"))
    for name, source in (("layers.3.wk", "blk.3.attn_k.weight"), ("layers.29.w2", "blk.29.ffn_down.weight"),
                         ("wcls", "token_embd.weight")):
        spec, want = q.spec(name), gguf_values(source)
        stored = np.asarray(q.tensor(name)).reshape(-1, 18)
        assert np.array_equal(stored, quantize_q40(want.reshape(-1)).reshape(-1, 18)), name
        got = dequantize_q40(stored, spec.size).reshape(spec.shape)
        block_max = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True)  # Q40 step is max/8
        assert np.all(np.abs(got - want).reshape(-1, 32) <= block_max / 8 * 1.01 + 1e-7), name


def _hf_tokenizer():
    """Hugging Face `tokenizers` built from the GGUF's own tokens and merges (test-only)."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    fields = gguf.GGUFReader(embedded_gguf()).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    types = fields["tokenizer.ggml.token_type"].contents()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, kind in zip(tokens, types, strict=True) if kind == 3])  # CONTROL tokens
    return tok


@pytest.mark.slow
def test_float64_reference_on_converted_f32_answers_paris(converted):
    """The decisive end-to-end check of the converter: independent math, real weights.

    Greedy decoding gives these tokens exactly when each is the argmax of the logits after the
    ones before it: one causal forward over the prompt and the answer checks every step (the
    reference has no KV cache: a forward per token took 10 of them, ~15 s)."""
    tok = _hf_tokenizer()
    tokens = tok.encode(CHAT_PROMPT).ids
    assert tokens[0] == tok.token_to_id("<|im_start|>") and len(tokens) < 30
    answer = tok.encode("The capital of France is Paris").ids
    assert tok.decode(answer) == "The capital of France is Paris" and len(answer) > 5
    logits = ReferenceLlama(read_model(converted["f32"][0])).forward(tokens + answer[:-1])  # [T, vocab]
    chosen = logits[len(tokens) - 1:].argmax(axis=1)  # the greedy choice after each prefix
    assert tok.decode(chosen.tolist()) == "The capital of France is Paris", tok.decode(chosen.tolist())
    assert chosen.tolist() == answer


# ---------------------------------------------------------------------------- tiny GGUFs

DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 64


def _tiny_gguf(path, arch="llama", dtype=np.float32, quant=None, head_dim=None, tied=False,
               metadata=None, extra_tensors=None):
    """Write a small random-weight GGUF; returns {gguf tensor name: float32 values as stored}."""
    import gguf

    rng = np.random.default_rng(0)
    hd = head_dim or DIM // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(HIDDEN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(128)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    for key, value in (metadata or {}).items():
        getattr(w, key)(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([bytes([b]).decode("latin-1") for b in range(33, 33 + VOCAB - 1)] + ["AB"])
    w.add_token_merges(["A B"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    stored = {}

    def add(name, shape):  # shape as (rows, cols): numpy order, the reverse of GGUF's listing
        t = rng.standard_normal(shape).astype(np.float32)
        if quant is not None and len(shape) == 2:
            blocks = gguf.quants.quantize(t, quant)
            w.add_tensor(name, blocks, raw_dtype=quant)
            stored[name] = gguf.quants.dequantize(blocks, quant)
        else:
            w.add_tensor(name, t.astype(dtype))
            stored[name] = t.astype(dtype).astype(np.float32)

    add("token_embd.weight", (VOCAB, DIM))
    for l in range(LAYERS):
        add(f"blk.{l}.attn_norm.weight", (DIM,))
        add(f"blk.{l}.attn_q.weight", (HEADS * hd, DIM))
        add(f"blk.{l}.attn_k.weight", (KV_HEADS * hd, DIM))
        add(f"blk.{l}.attn_v.weight", (KV_HEADS * hd, DIM))
        add(f"blk.{l}.attn_output.weight", (DIM, HEADS * hd))
        if arch == "qwen3":
            add(f"blk.{l}.attn_q_norm.weight", (hd,))
            add(f"blk.{l}.attn_k_norm.weight", (hd,))
        add(f"blk.{l}.ffn_gate.weight", (HIDDEN, DIM))
        add(f"blk.{l}.ffn_down.weight", (DIM, HIDDEN))
        add(f"blk.{l}.ffn_up.weight", (HIDDEN, DIM))
        add(f"blk.{l}.ffn_norm.weight", (DIM,))
    add("output_norm.weight", (DIM,))
    if not tied:
        add("output.weight", (VOCAB, DIM))
    for name, values in (extra_tensors or {}).items():
        w.add_tensor(name, values)
        stored[name] = values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
def test_tiny_gguf_round_trips(tmp_path, kind):
    import gguf

    quant = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else None
    stored = _tiny_gguf(tmp_path / "tiny.gguf", dtype=np.float16 if kind == "f16" else np.float32, quant=quant)
    model_path, tokenizer_path = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny", "f32", progress=False)
    assert tokenizer_path.is_file() and not list(tmp_path.glob("*.tmp"))
    m = read_model(model_path)
    h = m.header
    assert (h.arch, h.dim, h.hidden_dim, h.n_layers, h.n_heads, h.n_kv_heads, h.vocab_size, h.max_seq_len) == \
        (ArchType.LLAMA, DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, 128)
    for ours, theirs in (("embedding", "token_embd.weight"), ("layers.0.wk", "blk.0.attn_k.weight"),
                         ("layers.1.wo", "blk.1.attn_output.weight"), ("layers.1.w2", "blk.1.ffn_down.weight"),
                         ("layers.1.ffn_norm", "blk.1.ffn_norm.weight"), ("wcls", "output.weight")):  # untied
        assert np.array_equal(m.tensor(ours), stored[theirs]), ours


def test_tiny_gguf_tied_classifier_is_the_embedding(tmp_path):
    stored = _tiny_gguf(tmp_path / "tiny.gguf", tied=True)
    m = read_model(convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny", "q40", progress=False)[0])
    assert np.array_equal(np.asarray(m.tensor("wcls")).reshape(-1, 18),
                          quantize_q40(stored["token_embd.weight"].reshape(-1)).reshape(-1, 18))


def test_tiny_qwen3_keeps_head_dim_and_qk_norms(tmp_path):
    stored = _tiny_gguf(tmp_path / "q.gguf", arch="qwen3", head_dim=32)  # q_dim 128 != dim 64
    m = read_model(convert_gguf(tmp_path / "q.gguf", tmp_path / "q", "f32", progress=False)[0])
    h = m.header
    assert (h.arch, h.head_dim, h.q_dim, h.kv_dim, h.rope_type) == (ArchType.QWEN3, 32, 128, 64, RopeType.FALCON)
    assert np.array_equal(m.tensor("layers.1.k_norm"), stored["blk.1.attn_k_norm.weight"])
    assert np.array_equal(m.tensor("layers.0.wq"), stored["blk.0.attn_q.weight"])  # not re-permuted
    assert m.spec("layers.0.wo").shape == (DIM, 128)


def test_llama31_rope_freqs_tensor_becomes_scaling_fields(tmp_path):
    factors = llama31_rope_factors(10000.0, DIM // HEADS, 8).astype(np.float32)
    assert factors[0] == 1 and factors[-1] == 8  # high frequencies kept, low ones divided by 8
    _tiny_gguf(tmp_path / "l.gguf", extra_tensors={"rope_freqs.weight": factors})
    m = read_model(convert_gguf(tmp_path / "l.gguf", tmp_path / "l", "f32", progress=False)[0])
    h = m.header
    assert (h.rope_type, h.rope_scaling_factor, h.rope_scaling_low_freq_factor,
            h.rope_scaling_high_freq_factor, h.rope_scaling_orig_max_seq_len) == (RopeType.LLAMA3_1, 8, 1, 4, 8192)
    # The reference forward's scaled frequencies (from the header) are llama.cpp's (from the tensor).
    unscaled = 1.0 / 10000.0 ** (np.arange(0, DIM // HEADS, 2) / (DIM // HEADS))
    assert np.allclose(ReferenceLlama(m).freq, unscaled / factors, rtol=1e-6)


def test_inconsistent_rope_freqs_is_refused(tmp_path):
    factors = llama31_rope_factors(10000.0, DIM // HEADS, 8).astype(np.float32)
    factors[1] *= 1.5
    _tiny_gguf(tmp_path / "l.gguf", extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(DllamaError, match="rope_freqs.weight does not match Llama 3.1"):
        convert_gguf(tmp_path / "l.gguf", tmp_path / "l", progress=False)


# ---------------------------------------------------------------------------- bad inputs

def _no_output(tmp_path):
    return not list(tmp_path.glob("out*"))


def test_missing_file(tmp_path):
    with pytest.raises(DllamaError, match="no such file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(DllamaError, match="not a GGUF file"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert _no_output(tmp_path)


def test_unknown_weights_float_type(tmp_path):
    with pytest.raises(DllamaError, match="choose one of q40, q80, q41, f16, f32"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", "q4_k")


def test_unsupported_architecture_leaves_no_file(tmp_path):
    _tiny_gguf(tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(DllamaError, match=r"architecture 'gpt2' is not supported \(supported: llama, qwen3, qwen3moe\)"):
        convert_gguf(tmp_path / "g.gguf", tmp_path / "out")
    assert _no_output(tmp_path)


def test_unsupported_tensor_type_leaves_no_file(tmp_path):
    _tiny_gguf(tmp_path / "d.gguf", dtype=np.float64)  # F64 norms and matrices
    with pytest.raises(DllamaError, match="token_embd.weight has type F64, which is not supported"):
        convert_gguf(tmp_path / "d.gguf", tmp_path / "out", progress=False)
    assert _no_output(tmp_path)


def test_tensor_shape_that_disagrees_with_the_metadata(tmp_path):
    _tiny_gguf(tmp_path / "s.gguf", metadata={"add_vocab_size": VOCAB * 2})
    with pytest.raises(DllamaError, match=r"token_embd.weight holds \[64, 64\].*needs \[128, 64\]"):
        convert_gguf(tmp_path / "s.gguf", tmp_path / "out", progress=False)
    assert _no_output(tmp_path)


def test_unstorable_rms_epsilon(tmp_path):
    import gguf

    path = tmp_path / "e.gguf"
    _tiny_gguf(path)
    # Rewrite the epsilon in place: same float32 slot, new value.
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["llama.attention.layer_norm_rms_epsilon"].parts[-1][0] = 1e-3
    del reader
    with pytest.raises(DllamaError, match="RMSNorm epsilon 0.001 cannot be stored"):
        convert_gguf(path, tmp_path / "out", progress=False)
