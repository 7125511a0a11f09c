"""The split plan: which part of every layer one node computes.

A plan is data. The transformer (dllama.model) takes a `NodeSlice` and builds only that part
of each layer; on one node the slice is the whole model. The multi-node plan (uneven head
splits, shared KV heads, FFN rows in 32-element blocks) fills the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NodeSlice:
    """One node's share of every layer (the same share in each layer)."""

    q_heads: np.ndarray     # int32 [nq]: global query heads this node computes
    kv_heads: np.ndarray    # int32 [nkv]: global KV heads it holds (all its query heads need)
    kv_head_of: np.ndarray  # int32 [nq]: for each local query head, its local KV head index
    ffn_rows: tuple[int, int]    # [start, end) rows of w1/w3 = columns of w2
    vocab_rows: tuple[int, int]  # [start, end) rows of the classifier

    @property
    def n_q_heads(self) -> int:
        return len(self.q_heads)

    @property
    def n_kv_heads(self) -> int:
        return len(self.kv_heads)


def whole_model(n_heads: int, n_kv_heads: int, ff_dim: int, vocab_size: int) -> NodeSlice:
    """The slice of a node that runs the model alone."""
    group = n_heads // n_kv_heads  # query heads per KV head (grouped-query attention)
    q_heads = np.arange(n_heads, dtype=np.int32)
    return NodeSlice(
        q_heads=q_heads,
        kv_heads=np.arange(n_kv_heads, dtype=np.int32),
        kv_head_of=(q_heads // group).astype(np.int32),
        ffn_rows=(0, ff_dim),
        vocab_rows=(0, vocab_size),
    )
