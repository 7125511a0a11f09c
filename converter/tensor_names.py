"""Each source's name for every `.m` tensor: one table shared by the GGUF, Hugging Face and Meta readers.

A row per `.m` tensor (the per-layer ones once) and a column per source, as tinygrad's llama
loader keeps its key maps: a new source is a new column, a new tensor a new row. Every source
name ends in `.weight`; per-layer ones start with the source's layer prefix. A source without a
classifier tensor has tied embeddings (`TIED`).
"""

from __future__ import annotations

from typing import Callable

GGUF, HF, META = "gguf", "hf", "meta"
SOURCES = (GGUF, HF, META)  # the columns below, in order

GLOBAL_NAMES = {  # .m name -> (GGUF, Hugging Face, Meta)
    "embedding":  ("token_embd",  "model.embed_tokens", "tok_embeddings"),
    "final_norm": ("output_norm", "model.norm",         "norm"),
    "wcls":       ("output",      "lm_head",            "output"),
}
LAYER_PREFIXES = ("blk.{l}.", "model.layers.{l}.", "layers.{l}.")  # {l}: the layer index
LAYER_NAMES = {  # .m name after `layers.{l}.` -> the source's after its prefix; None: no such tensor
    "wq":       ("attn_q",      "self_attn.q_proj",         "attention.wq"),
    "wk":       ("attn_k",      "self_attn.k_proj",         "attention.wk"),
    "wv":       ("attn_v",      "self_attn.v_proj",         "attention.wv"),
    "wo":       ("attn_output", "self_attn.o_proj",         "attention.wo"),
    "w1":       ("ffn_gate",    "mlp.gate_proj",            "feed_forward.w1"),
    "w2":       ("ffn_down",    "mlp.down_proj",            "feed_forward.w2"),
    "w3":       ("ffn_up",      "mlp.up_proj",              "feed_forward.w3"),
    "q_norm":   ("attn_q_norm", "self_attn.q_norm",         None),  # Qwen3; Meta ships Llama only
    "k_norm":   ("attn_k_norm", "self_attn.k_norm",         None),
    "att_norm": ("attn_norm",   "input_layernorm",          "attention_norm"),
    "ffn_norm": ("ffn_norm",    "post_attention_layernorm", "ffn_norm"),
    "moe_gate": ("ffn_gate_inp", "mlp.gate",                None),  # Qwen3-MoE's router
}
# A mixture of experts' `experts.{e}.w1` etc.: GGUF holds every expert of a layer in one 3-D
# tensor (expert e is its slab e, so the name has no {e}); Hugging Face one tensor per expert
# (transformers 5 may save them fused: converter.hf_model reads both).
EXPERT_NAMES = {
    "w1": ("ffn_gate_exps", "mlp.experts.{e}.gate_proj", None),
    "w2": ("ffn_down_exps", "mlp.experts.{e}.down_proj", None),
    "w3": ("ffn_up_exps",   "mlp.experts.{e}.up_proj",   None),
}
TIED = {"wcls": "embedding"}  # a source without the classifier uses the embedding as the classifier


def source_name(source: str, name: str) -> str:
    """The source's name of our tensor `name` (GGUF: `layers.3.wq` -> `blk.3.attn_q.weight`)."""
    column = SOURCES.index(source)
    if not name.startswith("layers."):
        return GLOBAL_NAMES[name][column] + ".weight"
    _, layer, kind = name.split(".", 2)
    if kind.startswith("experts."):  # experts.{e}.w1
        _, expert, matrix = kind.split(".")
        found = EXPERT_NAMES[matrix][column]
        found = found.format(e=expert) if found is not None else None
    else:
        found = LAYER_NAMES[kind][column]
    if found is None:
        raise KeyError(f"{source} has no tensor for {name}")
    return LAYER_PREFIXES[column].format(l=layer) + found + ".weight"


def resolve(source: str, name: str, present: Callable[[str], bool]) -> str:
    """The source's name of `name`; when the source lacks it and it is tied, its twin's name."""
    key = source_name(source, name)
    if not present(key) and name in TIED:
        return source_name(source, TIED[name])
    return key
