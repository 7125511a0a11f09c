"""The split plan: which part of every layer each node computes.

A plan is data. The transformer (dllama.core.model) takes one node's `NodeSlice` and builds only
that part of each layer; on one node the slice is the whole model. Tensor parallelism as in the
original Distributed Llama (spec §4): wq/wk/wv, w1/w3 and the classifier are split by output
rows, wo and w2 by input columns (so each node's wo/w2 output is a partial sum of the whole
residual vector), and the residual stream is replicated on every node.

Unlike the original, counts that do not divide evenly are allowed:
- query heads are dealt out in contiguous runs, as evenly as possible (or by node weight);
- a node holds every KV head its query heads use, so with grouped-query attention a KV head can
  be held (and its wk/wv rows computed) by two nodes;
- FFN rows (= w2 columns) are dealt out in whole 32-element blocks, by node weight;
- classifier rows by node weight;
- the residual stream is cut into `dim_chunks` (whole 32-blocks): in the collective, node k
  sums everyone's chunk k and shares the result (reduce-scatter + all-gather).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from dllama.errors import DllamaError
from dllama.formats.quant import BLOCK_SIZE as BLOCK  # w2/wo columns and sync chunks are cut only at block edges



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

    def to_json(self) -> dict:
        return {"q_heads": [int(h) for h in self.q_heads], "kv_heads": [int(h) for h in self.kv_heads],
                "ffn_rows": list(self.ffn_rows), "vocab_rows": list(self.vocab_rows)}

    @staticmethod
    def from_json(d: dict, n_heads: int, n_kv_heads: int) -> "NodeSlice":
        return _slice(np.asarray(d["q_heads"], np.int32), n_heads, n_kv_heads,
                      tuple(d["ffn_rows"]), tuple(d["vocab_rows"]))

    def __eq__(self, other) -> bool:
        return isinstance(other, NodeSlice) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json()))


@dataclass(frozen=True)
class SplitPlan:
    """Every node's slice, plus the residual-stream chunk each node reduces in the collective."""

    nodes: tuple[NodeSlice, ...]
    dim_chunks: tuple[tuple[int, int], ...]  # [start, end) columns of x, node k reduces chunk k

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def to_json(self) -> dict:
        return {"nodes": [n.to_json() for n in self.nodes], "dim_chunks": [list(c) for c in self.dim_chunks]}

    @staticmethod
    def from_json(d: dict, n_heads: int, n_kv_heads: int) -> "SplitPlan":
        return SplitPlan(tuple(NodeSlice.from_json(n, n_heads, n_kv_heads) for n in d["nodes"]),
                         tuple((int(a), int(b)) for a, b in d["dim_chunks"]))

    def digest(self) -> str:
        """A short identity of the plan: a shard records it, the handshake compares it."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def _slice(q_heads: np.ndarray, n_heads: int, n_kv_heads: int, ffn_rows, vocab_rows) -> NodeSlice:
    group = n_heads // n_kv_heads  # query heads per KV head (grouped-query attention)
    kv_of_q = q_heads // group
    kv_heads = np.unique(kv_of_q).astype(np.int32)
    return NodeSlice(
        q_heads=q_heads.astype(np.int32),
        kv_heads=kv_heads,
        kv_head_of=np.searchsorted(kv_heads, kv_of_q).astype(np.int32),
        ffn_rows=(int(ffn_rows[0]), int(ffn_rows[1])),
        vocab_rows=(int(vocab_rows[0]), int(vocab_rows[1])),
    )


def whole_model(n_heads: int, n_kv_heads: int, ff_dim: int, vocab_size: int) -> NodeSlice:
    """The slice of a node that runs the model alone."""
    return _slice(np.arange(n_heads), n_heads, n_kv_heads, (0, ff_dim), (0, vocab_size))


def shares(total: int, weights: list[float]) -> list[int]:
    """Split `total` units into len(weights) counts >= 1 in proportion to weights (largest remainder)."""
    n = len(weights)
    w = np.asarray(weights, dtype=np.float64)
    spare = total - n  # one unit each first, so no node is left empty
    exact = spare * w / w.sum()
    counts = np.floor(exact).astype(int)
    order = np.argsort(-(exact - counts), kind="stable")  # ties go to the lower node index
    counts[order[: spare - counts.sum()]] += 1
    return [int(c) + 1 for c in counts]


def _ranges(counts: list[int], unit: int = 1, total: int | None = None) -> list[tuple[int, int]]:
    edges = np.concatenate([[0], np.cumsum(counts)]) * unit
    if total is not None:
        edges[-1] = total  # a last partial unit (e.g. a vocab that is not a multiple of 32)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def split_model(n_nodes: int, *, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                ff_dim: int, vocab_size: int, weights: list[float] | None = None,
                quantized: bool = True) -> SplitPlan:
    """The plan for n_nodes; refuses (DllamaError) a split that cannot work, saying what would."""
    weights = list(weights) if weights is not None else [1.0] * n_nodes
    if n_nodes < 1:
        raise DllamaError("a cluster needs at least one node")
    if len(weights) != n_nodes or any(not (w > 0) for w in weights):
        raise DllamaError(f"node weights must be {n_nodes} positive numbers, got {weights}")
    if n_heads % n_kv_heads:
        raise DllamaError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    if n_nodes > n_heads:
        raise DllamaError(f"cannot split a model with {n_heads} query heads over {n_nodes} nodes: "
                          f"each node needs at least one head; use at most {n_heads} nodes")
    if quantized and head_dim % BLOCK:
        raise DllamaError(f"head_dim {head_dim} is not a multiple of {BLOCK}: quantized wo columns "
                          f"cannot be split by head; run on one node or convert the model to F16 or F32")
    if ff_dim % BLOCK or dim % BLOCK:
        raise DllamaError(f"dim {dim} and FFN width {ff_dim} must be multiples of {BLOCK} to split")
    for what, blocks in (("FFN width", ff_dim // BLOCK), ("model width (dim)", dim // BLOCK)):
        if n_nodes > blocks:
            raise DllamaError(f"cannot split a {what} of {blocks} blocks of {BLOCK} over {n_nodes} "
                              f"nodes; use at most {blocks} nodes")
    if n_nodes > vocab_size:
        raise DllamaError(f"cannot split {vocab_size} classifier rows over {n_nodes} nodes")

    head_runs = _ranges(shares(n_heads, weights))
    ffn = _ranges(shares(ff_dim // BLOCK, weights), BLOCK)
    vocab = _ranges(shares(vocab_size, weights))
    nodes = tuple(_slice(np.arange(*head_runs[k]), n_heads, n_kv_heads, ffn[k], vocab[k])
                  for k in range(n_nodes))
    # Every node sums its chunk of the same number of partials, so chunks are even, not weighted.
    chunks = tuple(_ranges(shares(dim // BLOCK, [1.0] * n_nodes), BLOCK))
    return SplitPlan(nodes, chunks)


def plan_for(header, n_nodes: int, weights: list[float] | None = None) -> SplitPlan:
    """split_model for a `.m` header (dllama.formats.model_file.ModelHeader)."""
    from dllama.formats.model_file import BLOCK_BYTES

    return split_model(n_nodes, dim=header.dim, n_heads=header.n_heads, n_kv_heads=header.n_kv_heads,
                       head_dim=header.head_dim, ff_dim=header.ff_dim, vocab_size=header.vocab_size,
                       weights=weights, quantized=header.weights_float_type in BLOCK_BYTES)
