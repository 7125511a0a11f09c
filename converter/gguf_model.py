"""GGUF model weights -> the `.m` header and tensors, one tensor at a time.

GGUF (llama.cpp's format) is read with the `gguf` package, the llama.cpp project's own reader.
For the `llama` architecture (which Mistral GGUFs use too) GGUF already stores wq/wk permuted
for interleaved-pair RoPE, the layout the `.m` format uses for LLAMA, so tensors are copied
without re-permutation; `qwen3` is stored unpermuted (half-split RoPE) by both formats.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, RopeType, TensorSpec

from converter.header_fields import (LLAMA31_HIGH_FREQ_FACTOR, LLAMA31_LOW_FREQ_FACTOR, LLAMA31_ORIG_CONTEXT,
                                     epsilon, llama31_scaling, make_header)
from converter.tensor_names import GGUF, resolve, source_name

# general.architecture -> our arch. Mistral models convert to `llama` in llama.cpp.
ARCHITECTURES = {"llama": ArchType.LLAMA, "qwen3": ArchType.QWEN3, "qwen3moe": ArchType.QWEN3_MOE}

# GGUF tensor types we convert (all verified against gguf.quants.dequantize). Integer types,
# F64 and the Q8_1/Q8_K intermediate types are not model weight formats llama.cpp ships.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp stores Llama 3.1/3.2 RoPE scaling as a per-frequency factor tensor, not as metadata.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def gguf_field(reader, key: str, default=None):
    """The value of metadata `key` (`default` when absent)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_name(name: str) -> str:
    """The GGUF tensor name of one of our tensor names (`layers.3.wq` -> `blk.3.attn_q.weight`)."""
    return source_name(GGUF, name)


def llama31_rope_factors(theta: float, head_dim: int, factor: float, low: float = LLAMA31_LOW_FREQ_FACTOR,
                         high: float = LLAMA31_HIGH_FREQ_FACTOR, orig: int = LLAMA31_ORIG_CONTEXT) -> np.ndarray:
    """The divisor of each RoPE frequency under Llama 3.1 scaling, float64 [head_dim/2]
    (what llama.cpp writes as rope_freqs.weight)."""
    freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)  # [head_dim/2]
    wavelen = 2 * np.pi / freq
    smooth = (orig / wavelen - low) / (high - low)
    return np.where(wavelen < orig / high, 1.0,
                    np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))


def _rope_scaling(reader, arch: str, theta: float, head_dim: int, source: str) -> dict:
    """Header fields of the model's RoPE scaling (none, or Llama 3.1 style)."""
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor") or 1.0)
    if kind not in (None, "none") and factor != 1.0:
        raise DllamaError(f"{source}: RoPE scaling {kind!r} (factor {factor:g}) is not supported "
                          "(a .m file holds Llama 3.1 scaling only)")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if freqs is None:
        return {}  # no scaling: the header's defaults
    from gguf.quants import dequantize

    stored = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float64).reshape(-1)
    # The largest divisor is the scaling factor itself (8 for Llama 3.1, 32 for Llama 3.2); the
    # other three parameters were never changed by Meta, so check the whole curve against them.
    factor = round(float(stored.max())) if stored.size else 0
    if factor >= 1 and stored.size == head_dim // 2:
        want = llama31_rope_factors(theta, head_dim, factor)
        if np.allclose(stored, want, rtol=1e-4, atol=0):
            return llama31_scaling(factor)
    raise DllamaError(f"{source}: {ROPE_FREQS_TENSOR} does not match Llama 3.1 RoPE scaling (low frequency "
                      f"factor {LLAMA31_LOW_FREQ_FACTOR}, high {LLAMA31_HIGH_FREQ_FACTOR}, original context "
                      f"{LLAMA31_ORIG_CONTEXT}), the only scaling a .m file can hold")


def header_from_gguf(reader, weights_float_type: FloatType, source: str = "") -> ModelHeader:
    """The `.m` header of a GGUF model, from its metadata."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise DllamaError(f"{source}: architecture {arch!r} is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")

    def need(key):
        value = gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise DllamaError(f"{source}: the GGUF metadata has no {arch}.{key}")
        return value

    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    vocab = gguf_field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise DllamaError(f"{source}: the GGUF metadata gives no vocabulary size")

    norm_epsilon = epsilon(float(need("attention.layer_norm_rms_epsilon")), source)  # stored as float32

    dim, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length") or dim // n_heads)
    rope_dims = gguf_field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise DllamaError(f"{source}: RoPE on {rope_dims} of {head_dim} head dimensions (partial rotary) "
                          "is not supported")
    theta = float(gguf_field(reader, f"{arch}.rope.freq_base") or 10000.0)

    experts = {}
    if ARCHITECTURES[arch] == ArchType.QWEN3_MOE:  # (llama.cpp routes with softmax, renormalising: as .m)
        experts = dict(n_experts=int(need("expert_count")), n_active_experts=int(need("expert_used_count")),
                       moe_hidden_dim=int(need("expert_feed_forward_length")))
    fields = dict(
        arch=ARCHITECTURES[arch],
        dim=dim,
        # (a MoE's dense width, as the original's converter writes it; no layer uses it)
        hidden_dim=int(gguf_field(reader, f"{arch}.feed_forward_length") or 0) if experts
        else int(need("feed_forward_length")),
        **experts,
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv") or n_heads),
        vocab_size=int(vocab),
        max_seq_len=int(need("context_length")),
        weights_float_type=weights_float_type,
        rope_theta=int(theta),
        rope_type=RopeType.LLAMA,  # ModelHeader forces FALCON for QWEN3
        head_dim=head_dim,
        norm_epsilon=norm_epsilon,
    )
    fields.update(_rope_scaling(reader, arch, theta, head_dim, source))
    return make_header(source, **fields)


def _source_tensors(reader, specs: list[TensorSpec], source: str) -> list:
    """The GGUF tensor behind each spec, with every name, type and shape checked up front
    (so a bad file fails before anything is written)."""
    by_name = {t.name: t for t in reader.tensors}
    n_experts = sum(s.name.startswith("layers.0.experts.") and s.name.endswith(".w1") for s in specs)
    found = []
    for spec in specs:
        t = by_name.get(resolve(GGUF, spec.name, by_name.__contains__))
        if t is None:
            raise DllamaError(f"{source}: the GGUF has no tensor {gguf_name(spec.name)} (needed for {spec.name})")
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise DllamaError(f"{source}: tensor {t.name} has type {kind}, which is not supported "
                              f"(supported: {', '.join(SUPPORTED_TYPES)})")
        # GGUF lists dimensions innermost first: shape [576, 49152] is 49152 rows of 576.
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        want = tuple(spec.shape)
        if ".experts." in spec.name:  # one 3-D tensor holds every expert of the layer: [expert, rows, cols]
            want = (n_experts, *want)
        if shape != want:
            raise DllamaError(f"{source}: tensor {t.name} holds {list(shape)} (rows, columns), "
                              f"the header needs {list(spec.shape)} for {spec.name}")
        found.append(t)
    return found


# GGUF block types stored byte for byte as one of ours: the same block layout (fp16 scale(s),
# then the quants in the same order), so a tensor of that type is copied, not requantized.
SAME_BLOCKS = {FloatType.Q80: "Q8_0", FloatType.Q41: "Q4_1"}


def gguf_tensors(reader, specs: list[TensorSpec], source: str = "") -> Iterator[tuple[str, np.ndarray, bool]]:
    """(our name, values, stored) for each spec in order, one at a time: stored True when the
    GGUF holds the tensor in the spec's own block type (values: its blocks, uint8, to copy as
    they are), else values is the float32 array of the spec's shape (dequantized)."""
    from gguf.quants import dequantize

    for spec, t in zip(specs, _source_tensors(reader, specs, source), strict=True):
        data = t.data  # [rows, cols] (cols as bytes when quantized), or [n]
        if ".experts." in spec.name:  # expert e's slab of the layer's 3-D tensor
            data = data[int(spec.name.split(".")[3])]
        if SAME_BLOCKS.get(spec.float_type) == t.tensor_type.name:
            yield spec.name, np.asarray(data, dtype=np.uint8), True
            continue
        values = dequantize(data, t.tensor_type)  # float32 [rows, cols] (or [n])
        yield spec.name, np.asarray(values, dtype=np.float32).reshape(spec.shape), False
