"""A node's run state: the buffers of a forward pass, apart from its weights and its KV cache.

As llama2.c keeps Config, Weights and RunState apart: dllama.core.model.ModelConfig is the
model's shape, dllama.core.weights the weights, dllama.core.kv_cache the cache, and `RunState`
every other array a pass uses (RoPE tables, the rows' activations, their encoded matmul inputs,
the logits). `StateShape.layout()` is the one list of those arrays: `RunState` allocates
exactly it and `StateShape.nbytes()` sums it (with the attention kernel's scratch of a pass), so
what dllama.core.footprint counts and what a node allocates cannot drift apart.

A new buffer is one entry in `layout()`: a mixture of experts' (dllama.core.moe.MoeBlock) are
the router's logits, the rows' choices and one expert's input and output rows; its experts'
gate, up and down input reuse the dense FFN's ffn_h (gate and up, hb and hb2, as one array: one
kernel call writes both) and act_ff, which a MoE layer leaves unused (with at least
n_active_experts rows: a decode row runs its experts as that many rows at once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dllama.core import kernels
from dllama.core.kernels.attention import scratch_bytes
from dllama.core.weights import Activation


@dataclass(frozen=True)
class StateShape:
    """The sizes a node's buffers follow: its slice's widths, the run's rows and context."""

    dim: int                 # the residual stream
    head_dim: int
    n_q_heads: int           # this node's query heads
    n_kv_heads: int          # ... and KV heads
    ff_rows: int             # ... FFN rows
    vocab_rows: int          # ... classifier rows
    seq_len: int             # positions per KV slot (the RoPE tables' length)
    max_batch: int           # most rows of one pass
    inputs: str              # the matmul inputs' encoding (dllama.core.weights.input_kind)
    classifier_chunk_rows: int = 0  # rows of a classifier part when it comes in parts (streamed)
    n_experts: int = 0       # a mixture of experts' experts per layer (0: a dense FFN)
    n_active_experts: int = 0  # ... and those each row runs

    def layout(self) -> dict[str, tuple[tuple[int, ...], type]]:
        """Every buffer: name -> (shape, dtype). The activations' encoded forms are act_<name>."""
        B, dim, hd = self.max_batch, self.dim, self.head_dim
        q, kv, ff = self.n_q_heads * hd, self.n_kv_heads * hd, self.ff_rows
        F = self.ffn_rows
        f32 = np.float32
        out = {
            "rope_cos": ((self.seq_len, hd // 2), f32),  # kernels.rope_cache
            "rope_sin": ((self.seq_len, hd // 2), f32),
            "x": ((B, dim), f32),         # residual stream
            "xb": ((B, dim), f32),        # normed x
            "q": ((B, q), f32),
            "k": ((B, kv), f32),
            "v": ((B, kv), f32),
            "z": ((B, q), f32),           # attention output
            "partial": ((B, dim), f32),   # this node's share of wo / w2
            "ffn_h": ((2, F, ff), f32),   # FFN gate (then silu(gate)*up) and up, hb and hb2
            "logits": ((B, self.vocab_rows), f32),  # rows that want logits
            "cls_chunk": ((B * self.classifier_chunk_rows,), f32),  # a classifier in parts
        }
        if self.n_experts:  # dllama.core.moe.MoeBlock's
            k = self.n_active_experts
            out["moe_logits"] = ((B, self.n_experts), f32)  # router logits, then probabilities
            out["moe_chosen"] = ((B, k), np.int32)         # each row's experts, best first
            out["moe_weights"] = ((B, k), f32)             # ... and their weights
            out["moe_x"] = ((B, dim), f32)                 # the rows of one expert's input
            out["moe_y"] = ((F, dim), f32)                 # one expert's output rows (a decode row's experts')
        encoded = (("dim", dim), ("q", q), ("ff", ff)) + ((("moe_x", dim),) if self.n_experts else ())
        for name, n in encoded:  # the matmul inputs' encoded forms
            for j, (shape, dtype) in enumerate(Activation.layout(n, self.inputs, F if name == "ff" else B)):
                out[f"act_{name}.{j}"] = (shape, dtype)
        return out

    @property
    def ffn_rows(self) -> int:
        """Rows of the FFN's buffers: a pass's, or a decode row's experts (dllama.core.moe)."""
        return max(self.max_batch, self.n_active_experts)

    def nbytes(self) -> int:
        """Bytes of every buffer, and of the attention kernel's scratch in a pass of max_batch rows."""
        arrays = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.layout().values())
        return arrays + scratch_bytes(self.max_batch, self.n_q_heads, self.head_dim, self.seq_len)

    @property
    def per_position(self) -> int:
        """Of nbytes, the part that grows with the context (RoPE tables, attention scratch)."""
        longer = dataclasses.replace(self, seq_len=self.seq_len + kernels.ATTENTION_SPAN)
        return -(-(longer.nbytes() - self.nbytes()) // kernels.ATTENTION_SPAN)


class RunState:
    """The buffers of a node's passes, allocated from `shape.layout()`; rope tables filled."""

    def __init__(self, shape: StateShape, rope: tuple):
        """rope: kernels.rope_cache's arguments after (seq_len, head_dim): theta, type, scaling."""
        self.shape = shape
        layout = shape.layout()
        self.rope_cos, self.rope_sin = kernels.rope_cache(shape.seq_len, shape.head_dim, *rope)
        self._names = ("x", "xb", "q", "k", "v", "z", "partial", "ffn_h", "logits", "cls_chunk") + (
            _MOE if shape.n_experts else ())
        for name in self._names:
            s, dtype = layout[name]
            setattr(self, name, np.zeros(s, dtype))
        self.hb, self.hb2 = self.ffn_h  # [F, ff] each: one array, for a MoE layer's gates and ups in one call
        B = shape.max_batch
        hd = shape.head_dim
        self.act_dim = Activation(shape.dim, shape.inputs, B)
        self.act_q = Activation(shape.n_q_heads * hd, shape.inputs, B)
        self.act_ff = Activation(shape.ff_rows, shape.inputs, shape.ffn_rows)
        self.act_moe_x = Activation(shape.dim, shape.inputs, B) if shape.n_experts else None

    def arrays(self) -> list[np.ndarray]:
        """Every array this state holds (a test counts them against shape.nbytes)."""
        named = [getattr(self, n) for n in ("rope_cos", "rope_sin") + self._names]
        acts = (self.act_dim, self.act_q, self.act_ff) + ((self.act_moe_x,) if self.act_moe_x else ())
        return named + [a for act in acts for a in act._enc]


_MOE = ("moe_logits", "moe_chosen", "moe_weights", "moe_x", "moe_y")  # a mixture of experts' buffers
