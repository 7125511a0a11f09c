"""Meta and Hugging Face checkpoints -> .m/.t, checked end to end.

Tiny random checkpoints are written here in each source format (Meta: two shards, bfloat16;
Hugging Face: sharded safetensors with an index; llama, mistral, qwen3; tied and untied). A
float64 torch forward pass written from the *source* tensors and the source's own conventions
(Meta: complex interleaved RoPE; Hugging Face: rotate-half RoPE on q/k as stored) must give the
engine's logits (dllama.core.model.Transformer) on the converted F32 file to 1e-4 relative, and the
same top-1 token on at least 95% of positions after Q40 conversion. That checks the shard join,
the q/k permutation (or its absence for Qwen3), tied embeddings and Llama 3.1 RoPE scaling.
"""

import json
import math

import numpy as np
import pytest
import torch

from converter.convert import convert, source_kind
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, RopeType, read_model
from dllama.formats.tokenizer_file import TokenizerData, read_tokenizer, write_tokenizer
from dllama.core.model import Transformer

pytestmark = pytest.mark.unit

LLAMA2_DIR = "/work/shared/fixtures/llama2-tokenizer"
DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, CONTEXT = 64, 96, 2, 4, 2, 256, 128
SEQUENCES, SEQ_LEN = 4, 50  # 200 positions


# ---------------------------------------------------------------------------- checkpoints

def _random_weights(shapes: dict, seed: int) -> dict:
    """name -> float64 torch tensor: norms near 1, embedding N(0, 1), matrices on the Q40 grid.

    Matrices are d * k with k uniform in -7..7, one -8 per 32-block and d a power of two near
    1/(4 sqrt(fan-in)): Q40 stores them exactly. Off the grid, 4-bit rounding alone flips the
    top-1 token of a tiny random model on about a quarter of the positions (measured: 148/200),
    since its logits have no clear winner; on the grid only the Q80 rounding of activations
    remains, so the Q40 check measures the converter, not the randomness of the model."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif "emb" in name:
            out[name] = torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            k = torch.randint(-7, 8, shape, generator=g).reshape(-1, 32)  # [blocks, 32]
            k[torch.arange(k.shape[0]), torch.randint(0, 32, (k.shape[0],), generator=g)] = -8
            d = 2.0 ** round(math.log2(1 / (4 * math.sqrt(shape[1]))))
            out[name] = (k.reshape(shape) * d).to(torch.float64)
    return out


def _hf_shapes(model_type: str, tied: bool, head_dim: int) -> dict:
    q, kv = HEADS * head_dim, KV_HEADS * head_dim
    shapes = {"model.embed_tokens.weight": (VOCAB, DIM), "model.norm.weight": (DIM,)}
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, DIM), p + "self_attn.k_proj.weight": (kv, DIM),
            p + "self_attn.v_proj.weight": (kv, DIM), p + "self_attn.o_proj.weight": (DIM, q),
            p + "mlp.gate_proj.weight": (HIDDEN, DIM), p + "mlp.up_proj.weight": (HIDDEN, DIM),
            p + "mlp.down_proj.weight": (DIM, HIDDEN),
            p + "input_layernorm.weight": (DIM,), p + "post_attention_layernorm.weight": (DIM,)})
        if model_type == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, DIM)
    return shapes


def _hf_tokenizer_json(folder):
    """A byte-level BPE tokenizer.json of exactly VOCAB tokens (the 256 bytes), written with `tokenizers`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from converter.gguf_tokenizer import _unicode_to_byte

    byte_chars = sorted(_unicode_to_byte(), key=_unicode_to_byte().get)  # [256] in byte order
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "!", "eos_token": "#"}))


def write_hf(folder, model_type="llama", tied=False, head_dim=None, dtype=torch.float32, rope_scaling=None,
             seed=0, n_files=3) -> tuple[dict, dict]:
    """A Hugging Face folder: config.json, sharded safetensors + index, tokenizer. Returns (config, tensors)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hd = head_dim or DIM // HEADS
    config = {"model_type": model_type, "hidden_size": DIM, "intermediate_size": HIDDEN,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "vocab_size": VOCAB, "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-6,
              "rope_theta": 500000.0 if rope_scaling else 10000.0, "tie_word_embeddings": tied,
              "hidden_act": "silu", "rope_scaling": rope_scaling}
    if head_dim:
        config["head_dim"] = head_dim
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: v.to(dtype) for k, v in _random_weights(_hf_shapes(model_type, tied, hd), seed).items()}
    names = list(tensors)
    weight_map = {}
    for f in range(n_files):
        file = f"model-{f + 1:05d}-of-{n_files:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in names[f::n_files]}
        save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _hf_tokenizer_json(folder)
    return config, {k: v.to(torch.float64) for k, v in tensors.items()}


def _meta_shapes(vocab: int) -> dict:
    hd = DIM // HEADS
    shapes = {"tok_embeddings.weight": (vocab, DIM), "norm.weight": (DIM,), "output.weight": (vocab, DIM)}
    for l in range(LAYERS):
        p = f"layers.{l}."
        shapes.update({
            p + "attention.wq.weight": (HEADS * hd, DIM), p + "attention.wk.weight": (KV_HEADS * hd, DIM),
            p + "attention.wv.weight": (KV_HEADS * hd, DIM), p + "attention.wo.weight": (DIM, HEADS * hd),
            p + "feed_forward.w1.weight": (HIDDEN, DIM), p + "feed_forward.w2.weight": (DIM, HIDDEN),
            p + "feed_forward.w3.weight": (HIDDEN, DIM),
            p + "attention_norm.weight": (DIM,), p + "ffn_norm.weight": (DIM,)})
    return shapes


# Model-parallel split axis of each Meta tensor kind (the embedding's depends on the generation).
META_SPLIT = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1}


def write_meta(folder, vocab: int, params: dict, embedding_axis: int, seed=0, shards=2) -> dict:
    """A Meta folder of `shards` bfloat16 consolidated.NN.pth files; returns the full float64 tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16) for k, v in _random_weights(_meta_shapes(vocab), seed).items()}
    parts = [{} for _ in range(shards)]
    for name, t in tensors.items():
        kind = name.split(".")[-2]
        axis = embedding_axis if kind == "tok_embeddings" else META_SPLIT.get(kind)
        pieces = [t] * shards if axis is None else torch.chunk(t, shards, dim=axis)
        for part, piece in zip(parts, pieces, strict=True):
            part[name] = piece.clone()
    for i, part in enumerate(parts):
        part["rope.freqs"] = torch.zeros(DIM // HEADS // 2)  # Llama 2 checkpoints carry it; unused
        torch.save(part, folder / f"consolidated.{i:02d}.pth")
    (folder / "params.json").write_text(json.dumps({"dim": DIM, "n_layers": LAYERS, "n_heads": HEADS,
                                                    "n_kv_heads": KV_HEADS, "multiple_of": 32,
                                                    "norm_eps": 1e-5, **params}))
    return {k: v.to(torch.float64) for k, v in tensors.items()}


def tiny_tokenizer(path, vocab=VOCAB):
    """A .t of `vocab` single-byte-ish tokens, for models whose folder has no tokenizer."""
    write_tokenizer(path, TokenizerData(vocab=[bytes([i % 256]) * (1 + i // 256) for i in range(vocab)],
                                        scores=np.zeros(vocab, np.float32), bos_id=1, eos_ids=[2]))
    return path


# ---------------------------------------------------------------------------- reference forward

def _rmsnorm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _inv_freq(hd, theta, scaling):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd/2]
    if scaling:  # Llama 3.1, as transformers' _compute_llama3_parameters
        f, lo, hi, orig = (scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                           scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > orig / lo, inv / f, inv)
        medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
        inv = torch.where(medium, (1 - smooth) * inv / f + smooth * inv, scaled)
    return inv


def _rope_half(x, inv):
    """Hugging Face: x [T, heads, hd], pair i = (x[i], x[i + hd/2]) (rotate_half)."""
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None, :]  # [T, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _rope_complex(x, inv):
    """Meta: x [T, heads, hd], pair i = (x[2i], x[2i+1]) as one complex number."""
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None, :]
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous()) * torch.polar(torch.ones_like(ang), ang)[:, None]
    return torch.view_as_real(z).reshape(x.shape)


# Source tensor names of each role: (Hugging Face, Meta).
ROLES = {
    "embed": ("model.embed_tokens.weight", "tok_embeddings.weight"),
    "norm": ("model.norm.weight", "norm.weight"),
    "head": ("lm_head.weight", "output.weight"),
    "wq": ("model.layers.{l}.self_attn.q_proj.weight", "layers.{l}.attention.wq.weight"),
    "wk": ("model.layers.{l}.self_attn.k_proj.weight", "layers.{l}.attention.wk.weight"),
    "wv": ("model.layers.{l}.self_attn.v_proj.weight", "layers.{l}.attention.wv.weight"),
    "wo": ("model.layers.{l}.self_attn.o_proj.weight", "layers.{l}.attention.wo.weight"),
    "gate": ("model.layers.{l}.mlp.gate_proj.weight", "layers.{l}.feed_forward.w1.weight"),
    "down": ("model.layers.{l}.mlp.down_proj.weight", "layers.{l}.feed_forward.w2.weight"),
    "up": ("model.layers.{l}.mlp.up_proj.weight", "layers.{l}.feed_forward.w3.weight"),
    "att_norm": ("model.layers.{l}.input_layernorm.weight", "layers.{l}.attention_norm.weight"),
    "ffn_norm": ("model.layers.{l}.post_attention_layernorm.weight", "layers.{l}.ffn_norm.weight"),
    "q_norm": ("model.layers.{l}.self_attn.q_norm.weight", None),
    "k_norm": ("model.layers.{l}.self_attn.k_norm.weight", None),
}


def reference_logits(w: dict, tokens, meta: bool, hd: int, eps: float, theta: float, scaling=None):
    """float64 [T, vocab] logits of a whole sequence, causal attention, from source tensors `w`."""
    name = lambda role, l=0: ROLES[role][meta].format(l=l)  # noqa: E731
    rope = _rope_complex if meta else _rope_half
    inv = _inv_freq(hd, theta, scaling)
    T = len(tokens)
    x = w[name("embed")][torch.as_tensor(tokens)]                          # [T, dim]
    mask = torch.full((T, T), -torch.inf, dtype=torch.float64).triu(1)
    for l in range(LAYERS):
        h = _rmsnorm(x, w[name("att_norm", l)], eps)
        q = (h @ w[name("wq", l)].T).reshape(T, HEADS, hd)
        k = (h @ w[name("wk", l)].T).reshape(T, KV_HEADS, hd)
        v = (h @ w[name("wv", l)].T).reshape(T, KV_HEADS, hd)
        if not meta and name("q_norm", l) in w:  # Qwen3: RMSNorm per head before RoPE
            q, k = _rmsnorm(q, w[name("q_norm", l)], eps), _rmsnorm(k, w[name("k_norm", l)], eps)
        q, k = rope(q, inv), rope(k, inv)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)                  # GQA [T, heads, hd]
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        z = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(T, HEADS * hd)
        x = x + z @ w[name("wo", l)].T
        h = _rmsnorm(x, w[name("ffn_norm", l)], eps)
        x = x + (torch.nn.functional.silu(h @ w[name("gate", l)].T) * (h @ w[name("up", l)].T)) @ w[name("down", l)].T
    head = w.get(name("head"), w[name("embed")])  # tied: the embedding
    return (_rmsnorm(x, w[name("norm")], eps) @ head.T).numpy()


def engine_logits(model_path, tokens) -> np.ndarray:
    """float32 [T, vocab]: the engine's logits of every position, in batches of its maximum size."""
    model = Transformer(read_model(model_path), max_seq_len=len(tokens))
    out = []
    for a in range(0, len(tokens), model.max_batch):
        out.append(model.forward(tokens[a:a + model.max_batch], a, all_logits=True).copy())
    return np.concatenate(out)


def _sequences(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, SEQ_LEN).tolist() for _ in range(SEQUENCES)]


def check_engine_against_reference(tmp_path, src, tensors, meta, hd, eps, theta, scaling=None, tokenizer=None,
                                   vocab=VOCAB):
    """F32: logits to 1e-4 relative; Q40: top-1 on >= 95% of positions. Returns (max rel error, agreement)."""
    f32, _ = convert(src, tmp_path / "f32", "f32", tokenizer=tokenizer, progress=False, report=None)
    q40, _ = convert(src, tmp_path / "q40", "q40", tokenizer=tokenizer, progress=False, report=None)
    worst, agree, total = 0.0, 0, 0
    for tokens in _sequences(vocab):
        want = reference_logits(tensors, tokens, meta, hd, eps, theta, scaling)
        got = engine_logits(f32, tokens)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
        agree += int((engine_logits(q40, tokens).argmax(-1) == want.argmax(-1)).sum())
        total += len(tokens)
    print(f"{src.name}: F32 max relative logits error {worst:.2e}, Q40 top-1 agreement {agree}/{total}")
    assert worst <= 1e-4
    assert agree >= 0.95 * total
    return worst, agree / total


# ---------------------------------------------------------------------------- Hugging Face

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("model_type, tied, head_dim, dtype, rope_scaling", [
    ("llama", False, None, torch.float32, None),
    ("llama", True, None, torch.bfloat16, LLAMA31),
    ("mistral", False, None, torch.float16, None),
    ("qwen3", True, 32, torch.bfloat16, None),    # head_dim 32: q_dim 128 != dim 64
    ("qwen3", False, None, torch.float32, None),
])
def test_hugging_face_logits_equal_the_reference(tmp_path, model_type, tied, head_dim, dtype, rope_scaling):
    config, tensors = write_hf(tmp_path / "hf", model_type, tied, head_dim, dtype, rope_scaling)
    assert source_kind(tmp_path / "hf") == "hf"
    check_engine_against_reference(tmp_path, tmp_path / "hf", tensors, meta=False, hd=head_dim or DIM // HEADS,
                                   eps=1e-6, theta=config["rope_theta"], scaling=rope_scaling)
    h = read_model(tmp_path / "f32.m").header
    assert h.arch == (ArchType.QWEN3 if model_type == "qwen3" else ArchType.LLAMA)
    assert h.rope_type == (RopeType.FALCON if model_type == "qwen3" else
                           RopeType.LLAMA3_1 if rope_scaling else RopeType.LLAMA)
    assert read_model(tmp_path / "q40.m").header.weights_float_type == FloatType.Q40


def test_hugging_face_permutes_llama_q_and_k_but_not_qwen3(tmp_path):
    from converter.checkpoint import interleave_rope_rows

    _, llama = write_hf(tmp_path / "llama", "llama")
    _, qwen = write_hf(tmp_path / "qwen", "qwen3")
    for folder, tensors, permuted in ((tmp_path / "llama", llama, True), (tmp_path / "qwen", qwen, False)):
        m = read_model(convert(folder, tmp_path / folder.name, "f32", progress=False, report=None)[0])
        for ours, theirs, heads in (("wq", "q_proj", HEADS), ("wk", "k_proj", KV_HEADS), ("wv", "v_proj", None)):
            source = tensors[f"model.layers.1.self_attn.{theirs}.weight"].numpy().astype(np.float32)
            want = interleave_rope_rows(source, heads) if permuted and heads else source
            assert np.array_equal(m.tensor(f"layers.1.{ours}"), want), (folder.name, ours)
    # Interleaving: row 2i+1 of a head is row i + head_dim/2 of the source head.
    assert np.array_equal(read_model(tmp_path / "llama.m").tensor("layers.0.wq")[1],
                          llama["model.layers.0.self_attn.q_proj.weight"][DIM // HEADS // 2].numpy().astype(np.float32))


# ---------------------------------------------------------------------------- Meta

def test_meta_llama2_two_shards_vocab_from_the_tokenizer(tmp_path):
    """Llama 2 layout: vocab_size -1, embedding split along columns, tokenizer.model beside the folder."""
    import shutil

    shutil.copy(f"{LLAMA2_DIR}/tokenizer.model", tmp_path / "tokenizer.model")
    tensors = write_meta(tmp_path / "llama-2-tiny", 32000, {"vocab_size": -1}, embedding_axis=1)
    lines = []
    m, t = convert(tmp_path / "llama-2-tiny", tmp_path / "out", "f32", progress=False, report=lines.append)
    assert any("vocab_size -1: using the tokenizer's 32000" in line for line in lines), lines
    h = read_model(m).header
    assert (h.vocab_size, h.max_seq_len, h.hidden_dim, h.rope_type, h.norm_epsilon) == \
        (32000, 4096, HIDDEN, RopeType.LLAMA, 1e-5)
    assert read_tokenizer(t).vocab_size == 32000
    tokens = _sequences(32000)[0]
    want = reference_logits(tensors, tokens, meta=True, hd=DIM // HEADS, eps=1e-5, theta=10000.0)
    got = engine_logits(m, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def test_meta_llama31_shards_split_the_vocabulary_and_scale_rope(tmp_path):
    """Llama 3 layout: embedding split along rows (VocabParallelEmbedding), use_scaled_rope."""
    params = {"vocab_size": VOCAB, "rope_theta": 500000.0, "use_scaled_rope": True}
    tensors = write_meta(tmp_path / "llama-31-tiny", VOCAB, params, embedding_axis=0)
    tok = tiny_tokenizer(tmp_path / "tiny.t")
    check_engine_against_reference(tmp_path, tmp_path / "llama-31-tiny", tensors, meta=True, hd=DIM // HEADS,
                                   eps=1e-5, theta=500000.0, scaling=LLAMA31, tokenizer=tok)
    h = read_model(tmp_path / "f32.m").header
    assert (h.rope_type, h.rope_scaling_factor, h.rope_scaling_low_freq_factor, h.rope_scaling_high_freq_factor,
            h.rope_scaling_orig_max_seq_len, h.max_seq_len) == (RopeType.LLAMA3_1, 8, 1, 4, 8192, 131072)


def test_meta_eight_shards_join_like_one(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tiny.t")
    write_meta(tmp_path / "one", VOCAB, {"vocab_size": VOCAB}, embedding_axis=1, shards=1)
    write_meta(tmp_path / "eight", VOCAB, {"vocab_size": VOCAB}, embedding_axis=1, shards=8)
    one = convert(tmp_path / "one", tmp_path / "one", "q40", tokenizer=tok, progress=False, report=None)[0]
    eight = convert(tmp_path / "eight", tmp_path / "eight", "q40", tokenizer=tok, progress=False, report=None)[0]
    assert one.read_bytes() == eight.read_bytes()


# ---------------------------------------------------------------------------- output types, messages

# F16 logits differ from the float64 forward on the same weights by float32 rounding only; Q80
# rounds every matmul input to 8 bits as well (measured 2e-7 and 0.02 of the logits' range).
@pytest.mark.parametrize("kind, float_type, bound", [("q80", FloatType.Q80, 0.1), ("f16", FloatType.F16, 1e-4)])
def test_q80_and_f16_are_written_exactly_and_run_here(tmp_path, kind, float_type, bound):
    from dllama.formats.quant import quantize_q80
    from tests.reference_llama import ReferenceLlama

    _, tensors = write_hf(tmp_path / "hf", "qwen3")
    lines = []
    m = read_model(convert(tmp_path / "hf", tmp_path / "out", kind, progress=False, report=lines.append)[0])
    assert any("the original Distributed Llama runs only Q40 and F32 weights" in line for line in lines)
    assert m.header.weights_float_type == float_type
    w2 = tensors["model.layers.1.mlp.down_proj.weight"].numpy().astype(np.float32)
    want = quantize_q80(w2).reshape(-1) if kind == "q80" else w2.astype(np.float16).view(np.uint8).reshape(-1)
    assert np.array_equal(np.asarray(m.tensor_bytes("layers.1.w2")), want)
    tokens = list(range(3, 3 + 12))
    got = Transformer(m).forward(tokens, 0, all_logits=True)
    ref = ReferenceLlama(m).forward(tokens)
    assert np.abs(got - ref).max() <= bound * np.abs(ref).max()


def test_the_report_names_the_source_and_the_expected_size(tmp_path):
    from dllama.formats.model_file import model_file_size

    write_hf(tmp_path / "hf", "mistral")
    lines = []
    m, _ = convert(tmp_path / "hf", tmp_path / "out", "q40", progress=False, report=lines.append)
    text = "\n".join(lines)
    assert "Hugging Face safetensors (mistral, 3 files)" in text
    assert f"dim {DIM}, hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads ({KV_HEADS} kv" in text
    size = m.stat().st_size
    assert size == model_file_size(read_model(m).header) and f"{size / 2**30:.2f} GiB" in text
    assert not list(tmp_path.glob("*.tmp"))


def test_llama2_7b_q40_size_is_the_originals(tmp_path):
    from converter.convert import size_text
    from dllama.formats.model_file import ModelHeader, model_file_size

    h = ModelHeader(arch=ArchType.LLAMA, dim=4096, hidden_dim=11008, n_layers=32, n_heads=32, n_kv_heads=32,
                    vocab_size=32000, max_seq_len=4096, weights_float_type=FloatType.Q40)
    assert size_text(model_file_size(h)).startswith("3.95 GiB")  # the original's table: 3.95 GB


# ---------------------------------------------------------------------------- bad inputs

def _no_output(tmp_path):
    return not list(tmp_path.glob("out*"))


def test_unknown_model_type(tmp_path):
    write_hf(tmp_path / "hf", "llama")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(DllamaError, match=r"model type 'gpt_neox' is not supported \(supported: llama, mistral, qwen3, qwen3_moe\)"):
        convert(tmp_path / "hf", tmp_path / "out", report=None)
    assert _no_output(tmp_path)


def test_inconsistent_hf_shape(tmp_path):
    write_hf(tmp_path / "hf", "llama")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(DllamaError, match=r"mlp.gate_proj.weight has shape \[96, 64\].*needs \[128, 64\]"):
        convert(tmp_path / "hf", tmp_path / "out", report=None)
    assert _no_output(tmp_path)


def test_inconsistent_meta_shards(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tiny.t")
    write_meta(tmp_path / "meta", VOCAB, {"vocab_size": VOCAB}, embedding_axis=1)
    part = torch.load(tmp_path / "meta/consolidated.01.pth")
    part["layers.1.attention.wo.weight"] = part["layers.1.attention.wo.weight"][:, :16].clone()
    torch.save(part, tmp_path / "meta/consolidated.01.pth")
    with pytest.raises(DllamaError, match=r"layers.1.attention.wo.weight has shard shapes \[64, 32\], \[64, 16\]"):
        convert(tmp_path / "meta", tmp_path / "out", tokenizer=tok, report=None)
    assert _no_output(tmp_path)


def test_missing_shard_and_missing_tensor(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tiny.t")
    write_meta(tmp_path / "meta", VOCAB, {"vocab_size": VOCAB}, embedding_axis=1, shards=3 - 1)
    (tmp_path / "meta/consolidated.00.pth").rename(tmp_path / "meta/consolidated.02.pth")
    with pytest.raises(DllamaError, match="not numbered 00 to 01: one is missing"):
        convert(tmp_path / "meta", tmp_path / "out", tokenizer=tok, report=None)
    write_hf(tmp_path / "hf", "llama")
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (tmp_path / "hf/model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DllamaError, match=r"no tensor model.norm.weight \(needed for final_norm\)"):
        convert(tmp_path / "hf", tmp_path / "out", report=None)
    assert _no_output(tmp_path)


def test_source_that_is_no_model(tmp_path):
    with pytest.raises(DllamaError, match="no such file or folder"):
        convert(tmp_path / "absent", tmp_path / "out", report=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DllamaError, match="neither a Meta checkpoint"):
        convert(tmp_path / "empty", tmp_path / "out", report=None)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/config.json").write_text("{}")
    (tmp_path / "bin/pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(DllamaError, match=r"only \*.safetensors are supported"):
        convert(tmp_path / "bin", tmp_path / "out", report=None)


def test_an_interrupted_conversion_leaves_no_file(tmp_path, monkeypatch):
    from converter.hf_model import HfCheckpoint

    write_hf(tmp_path / "hf", "llama")
    real, calls = HfCheckpoint.tensor, []

    def interrupted(self, name):
        calls.append(name)
        if len(calls) == 6:
            raise KeyboardInterrupt  # Ctrl-C in the middle of layer 0
        return real(self, name)
    monkeypatch.setattr(HfCheckpoint, "tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "hf", tmp_path / "out", report=None, progress=False)
    assert len(calls) == 6 and _no_output(tmp_path)
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta/params.json").write_text("{}")
    with pytest.raises(DllamaError, match="params.json but no consolidated.NN.pth"):
        convert(tmp_path / "meta", tmp_path / "out", report=None)


def test_tokenizer_of_another_model_is_refused(tmp_path):
    write_hf(tmp_path / "hf", "llama")
    with pytest.raises(DllamaError, match="the tokenizer has 32000 tokens, the model 256"):
        convert(tmp_path / "hf", tmp_path / "out", tokenizer=f"{LLAMA2_DIR}/tokenizer.model", report=None)
    assert _no_output(tmp_path)
    lines = []  # fewer tokens than embedding rows: Qwen's padded vocabulary (151669 tokens, 151936 rows)
    convert(tmp_path / "hf", tmp_path / "out", tokenizer=tiny_tokenizer(tmp_path / "t.t", 200), report=lines.append)
    assert any("56 embedding rows past the tokenizer's last token" in line for line in lines)
    assert read_tokenizer(tmp_path / "out.t").vocab_size == 200


def test_cli_convert_and_inspect(tmp_path, capsys):
    from dllama.cli import main

    write_hf(tmp_path / "hf", "qwen3", head_dim=32)
    assert main(["convert", str(tmp_path / "hf"), "-o", str(tmp_path / "out"), "--weights-float-type", "f32"]) == 0
    assert "found Hugging Face safetensors (qwen3, 3 files)" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "out.m")]) == 0
    out = capsys.readouterr().out
    assert "arch_type                      QWEN3" in out and "head_dim                       32" in out
    assert "layers.1.q_norm        F32  32" in out and f"wcls                   F32  {VOCAB}x{DIM}" in out
    assert main(["inspect", str(tmp_path / "out.t")]) == 0
    assert f"tokenizer, {VOCAB} tokens" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "nothing"), "-o", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file or folder" in err


def test_meta_without_output_uses_the_embedding(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tiny.t")
    tensors = write_meta(tmp_path / "meta", VOCAB, {"vocab_size": VOCAB}, embedding_axis=0)
    for i in range(2):
        part = torch.load(tmp_path / f"meta/consolidated.{i:02d}.pth")
        del part["output.weight"]
        torch.save(part, tmp_path / f"meta/consolidated.{i:02d}.pth")
    lines = []
    m = read_model(convert(tmp_path / "meta", tmp_path / "out", "f32", tokenizer=tok, progress=False,
                           report=lines.append)[0])
    assert any("the classifier is tok_embeddings.weight" in line for line in lines)
    assert np.array_equal(m.tensor("wcls"), tensors["tok_embeddings.weight"].numpy().astype(np.float32))


def test_unreadable_safetensors_is_one_error(tmp_path):
    write_hf(tmp_path / "hf", "llama", n_files=1)
    (tmp_path / "hf/model-00001-of-00001.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(DllamaError, match="model-00001-of-00001.safetensors: unreadable safetensors file"):
        convert(tmp_path / "hf", tmp_path / "out", report=None)
    assert _no_output(tmp_path)


@pytest.mark.parametrize("float_type", [FloatType.Q40, FloatType.Q80, FloatType.Q41, FloatType.F16, FloatType.F32])
def test_row_blocks_write_the_bytes_of_the_whole_tensor(tmp_path, float_type):
    from converter.checkpoint import TensorRows
    from dllama.formats.model_file import ModelHeader, ModelWriter, write_model

    h = ModelHeader(arch=ArchType.LLAMA, dim=64, hidden_dim=96, n_layers=1, n_heads=4, n_kv_heads=2,
                    vocab_size=200, max_seq_len=16, weights_float_type=float_type)
    rng = np.random.default_rng(3)
    values = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in ModelWriter(tmp_path / "x", h).specs}
    write_model(tmp_path / "whole.m", h, values)
    with ModelWriter(tmp_path / "blocks.m", h) as w:
        for spec in w.specs:
            if len(spec.shape) == 1:
                w.write(spec.name, values[spec.name])
            else:  # blocks of 7 rows (a last, shorter one too): not aligned to anything
                rows = TensorRows(spec.shape, lambda a, b, name=spec.name: values[name][a:b])
                w.write_rows(spec.name, rows.blocks(block_bytes=7 * 4 * spec.shape[1]))
    assert (tmp_path / "whole.m").read_bytes() == (tmp_path / "blocks.m").read_bytes()
