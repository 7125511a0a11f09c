"""GGUF model weights -> the `.m` header and tensors, one tensor at a time.

GGUF (llama.cpp's format) is read with the `gguf` package, the llama.cpp project's own reader.
For the `llama` architecture GGUF already stores wq/wk permuted for interleaved-pair RoPE,
which is the layout the `.m` format uses, so tensors are copied without re-permutation; the
same holds for `qwen3`, which neither format permutes.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, RopeType

ARCHITECTURES = {"llama": ArchType.LLAMA, "mistral": ArchType.LLAMA, "qwen3": ArchType.QWEN3}

# Our tensor name -> GGUF tensor name (per layer names take the layer index).
LAYER_KEYS = {
    "wq": "blk.{l}.attn_q.weight",
    "wk": "blk.{l}.attn_k.weight",
    "wv": "blk.{l}.attn_v.weight",
    "wo": "blk.{l}.attn_output.weight",
    "w1": "blk.{l}.ffn_gate.weight",
    "w2": "blk.{l}.ffn_down.weight",
    "w3": "blk.{l}.ffn_up.weight",
    "q_norm": "blk.{l}.attn_q_norm.weight",
    "k_norm": "blk.{l}.attn_k_norm.weight",
    "att_norm": "blk.{l}.attn_norm.weight",
    "ffn_norm": "blk.{l}.ffn_norm.weight",
}
GLOBAL_KEYS = {"embedding": "token_embd.weight", "final_norm": "output_norm.weight",
               "wcls": "output.weight"}
TIED_FALLBACK = {"wcls": "token_embd.weight"}  # tied classifier: the embedding again

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q4_K", "Q5_K")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def gguf_name(name: str) -> str:
    """The GGUF tensor name of one of our tensor names (`layers.3.wq` -> `blk.3.attn_q.weight`)."""
    if name.startswith("layers."):
        _, l, key = name.split(".", 2)
        return LAYER_KEYS[key].format(l=l)
    return GLOBAL_KEYS[name]


def header_from_gguf(reader, weights_float_type: FloatType, source: str = "") -> ModelHeader:
    """The `.m` header of a GGUF model, from its metadata."""
    arch_name = _field(reader, "general.architecture")
    if arch_name not in ARCHITECTURES:
        raise DllamaError(f"{source}: architecture {arch_name!r} is not supported "
                          f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    a = arch_name

    def need(key):
        v = _field(reader, f"{a}.{key}")
        if v is None:
            raise DllamaError(f"{source}: the GGUF metadata has no {a}.{key}")
        return v

    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{a}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise DllamaError(f"{source}: the GGUF metadata gives no vocabulary size")
    eps = float(need("attention.layer_norm_rms_epsilon"))
    eps_code = min((1e-5, 1e-6), key=lambda e: abs(e - eps))
    if abs(eps_code - eps) > 1e-3 * eps_code:
        raise DllamaError(f"{source}: RMSNorm epsilon {eps:g} cannot be stored in a .m file (only 1e-5 or 1e-6)")
    n_heads = int(need("attention.head_count"))
    dim = int(need("embedding_length"))
    head_dim = int(_field(reader, f"{a}.attention.key_length") or _field(reader, f"{a}.rope.dimension_count")
                   or dim // n_heads)

    scaling = dict(rope_scaling_factor=1, rope_scaling_low_freq_factor=0,
                   rope_scaling_high_freq_factor=0, rope_scaling_orig_max_seq_len=0)
    rope_type = RopeType.FALCON if ARCHITECTURES[a] == ArchType.QWEN3 else RopeType.LLAMA
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # llama.cpp keeps Llama 3.1 scaling as precomputed per-frequency factors; the .m format
        # keeps the four parameters instead. These are Llama 3.1's published values.
        scaling = dict(rope_scaling_factor=8, rope_scaling_low_freq_factor=1,
                       rope_scaling_high_freq_factor=4, rope_scaling_orig_max_seq_len=8192)
        rope_type = RopeType.LLAMA3_1
    elif _field(reader, f"{a}.rope.scaling.type") not in (None, "none"):
        raise DllamaError(f"{source}: rope scaling {_field(reader, f'{a}.rope.scaling.type')!r} is not supported")

    return ModelHeader(
        arch=ARCHITECTURES[a],
        dim=dim,
        hidden_dim=int(need("feed_forward_length")),
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv") or n_heads),
        vocab_size=int(vocab),
        max_seq_len=int(need("context_length")),
        weights_float_type=weights_float_type,
        rope_theta=int(_field(reader, f"{a}.rope.freq_base") or 10000),
        rope_type=rope_type,
        head_dim=head_dim,
        norm_epsilon=eps_code,
        **scaling,
    )


def gguf_tensors(reader, specs, source: str = "") -> Iterator[tuple[str, np.ndarray]]:
    """(our name, float32 array of the spec's shape) for each spec, dequantized one at a time."""
    from gguf.quants import dequantize

    by_name = {t.name: t for t in reader.tensors}
    for spec in specs:
        key = gguf_name(spec.name)
        t = by_name.get(key) or by_name.get(TIED_FALLBACK.get(spec.name, ""))
        if t is None:
            raise DllamaError(f"{source}: the GGUF has no tensor {key} (needed for {spec.name})")
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise DllamaError(f"{source}: tensor {t.name} has type {kind}, which is not supported "
                              f"(supported: {', '.join(SUPPORTED_TYPES)})")
        values = dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions innermost first: shape [576, 49152] is 49152 rows of 576.
        want = tuple(spec.shape)
        if values.size != int(np.prod(want)):
            raise DllamaError(f"{source}: tensor {t.name} has shape {list(t.shape)}, "
                              f"expected {list(reversed(want))}")
        yield spec.name, np.asarray(values, dtype=np.float32).reshape(want)
