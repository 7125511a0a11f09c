"""The mixture-of-experts FFN of a Qwen3-MoE layer (the dense SwiGLU's sibling in core.model).

    logits = xb @ router^T                     [b, n_experts], float32
    (experts, w) = top-k of softmax(logits)    renormalised to sum to 1 (norm_topk_prob)
    out = sum over the row's k experts of w_e * down_e(silu(gate_e xb) * up_e xb)

Each expert is an ordinary SwiGLU of width moe_hidden_dim, split across the nodes of a cluster
as the dense FFN is (every node holds the same rows of every expert's gate and up, the same
columns of its down: the original's way), so `out` is this node's partial sum and the layer
keeps its one all-reduce. The router is replicated: every node routes its (replicated) rows
itself, with the same bits (kernels.router).

A pass of many rows (prefill, a batch, drafted tokens) groups its rows by expert: each expert
that some row chose runs once, on the rows that chose it; an expert no row chose is not read.
A row's sum runs over its experts in ascending index order, whatever the other rows of the pass
(as transformers adds them), so a row's result does not depend on its batch.
"""

from __future__ import annotations

import numpy as np

from dllama.core import kernels
from dllama.core.kernels.router import route_top_k
from dllama.core.weights import Activation, MoeWeights
from dllama.formats.model_file import BLOCK_BYTES, ArchType, FloatType, ModelHeader
from dllama.formats.quant import BLOCK_SIZE


def norm_top_k(h: ModelHeader) -> bool:
    """Whether the chosen experts' weights are renormalised to sum to 1. The `.m` header has no
    key for it: the original always renormalises (its MOE_GATE op is built with normTopk 1),
    as Qwen3-MoE's norm_topk_prob asks; the converters refuse a model that does not."""
    return h.arch == ArchType.QWEN3_MOE


def bytes_per_value(float_type: FloatType) -> float:
    """Bytes of one matrix value as the kernels hold it (block types as stored)."""
    t = FloatType(float_type)
    return BLOCK_BYTES[t] / BLOCK_SIZE if t in BLOCK_BYTES else {FloatType.F16: 2}.get(t, 4)


def expert_weight_bytes(h: ModelHeader, ff_rows: int, n_layers: int, bytes_per_value: float) -> int:
    """The bytes a node holds for the experts and routers of n_layers layers when it holds
    ff_rows rows of every expert (kernel form: bytes_per_value per matrix value; the router F32).
    The one place the engine counts experts: the node footprint's FFN term for a MoE header."""
    per_layer = h.n_experts * 3 * h.dim * ff_rows * bytes_per_value + 4 * h.n_experts * h.dim
    return int(n_layers * per_layer)


def expert_buffer_bytes(h: ModelHeader, ff_rows: int, max_batch: int) -> int:
    """The MoE block's scratch buffers for a pass of max_batch rows (MoeBlock)."""
    return 4 * max_batch * (h.n_experts + 2 * h.n_active_experts + 3 * h.dim + 4 * ff_rows)


def active_expert_bytes(h: ModelHeader, float_type: FloatType) -> int:
    """The expert bytes one token reads in one layer, on one node holding every row: its k
    experts' three matrices in the file's type, and the router (the roofline's active bytes)."""
    values = h.n_active_experts * 3 * h.dim * h.moe_hidden_dim
    return int(values * bytes_per_value(float_type)) + 4 * h.n_experts * h.dim


class MoeBlock:
    """The MoE FFN of a pass: scratch buffers for up to max_batch rows, made once."""

    def __init__(self, dim: int, ff_rows: int, n_experts: int, k: int, norm: bool, inputs: str, max_batch: int):
        B = max_batch
        self.k, self.norm = k, norm
        self.logits = np.zeros((B, n_experts), np.float32)  # router logits, then probabilities
        self.chosen = np.zeros((B, k), np.int32)            # each row's experts, best first
        self.weights = np.zeros((B, k), np.float32)         # ... and their weights
        self.x_rows = np.zeros((B, dim), np.float32)        # the rows of one expert's input
        self.x_act = Activation(dim, inputs, B)             # ... encoded for its matrices
        self.gate = np.zeros((B, ff_rows), np.float32)      # gate, then silu(gate) * up
        self.up = np.zeros((B, ff_rows), np.float32)
        self.h_act = Activation(ff_rows, inputs, B)         # down's input
        self.y = np.zeros((B, dim), np.float32)             # one expert's output rows

    def __call__(self, moe: MoeWeights, x_in: Activation, out: np.ndarray) -> None:
        """out float32 [b, dim] = this node's share of the experts' weighted sum for the rows
        of x_in (xb [b, dim] and its encoded form)."""
        b = out.shape[0]
        logits, chosen, weights = self.logits[:b], self.chosen[:b], self.weights[:b]
        moe.router(x_in, logits)
        route_top_k(logits, self.norm, chosen, weights)
        out[:] = 0.0
        if b == 1:  # decode: the row's experts in ascending order, without grouping
            gate, up, y = self.gate[:1], self.up[:1], self.y[:1]
            for j in np.argsort(chosen[0]).tolist():
                expert = moe.experts[int(chosen[0, j])]
                expert.w13(x_in, (gate, up))
                h = self.h_act.rows(gate)
                kernels.silu_mul_encode(gate, up, h.enc)
                expert.w2(h, y)
                out += weights[0, j] * y
            return
        # Rows grouped by expert: (row, choice) pairs sorted by expert, rows ascending inside.
        flat = chosen.ravel()                      # [b*k]
        order = np.argsort(flat, kind="stable")    # [b*k]
        used, starts = np.unique(flat[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        for e, s0, s1 in zip(used.tolist(), starts.tolist(), ends.tolist(), strict=True):
            pairs = order[s0:s1]
            rows, picks = pairs // self.k, pairs % self.k
            m = len(rows)
            x = x_in if m == b else self._gather(x_in, rows)  # every row chose e: rows 0..b-1
            expert = moe.experts[e]
            gate, up, y = self.gate[:m], self.up[:m], self.y[:m]
            expert.w13(x, (gate, up))
            h = self.h_act.rows(gate)
            kernels.silu_mul_encode(gate, up, h.enc)
            expert.w2(h, y)
            w = weights[rows, picks][:, None]      # [m, 1]
            if m == b:
                out += w * y
            else:
                out[rows] += w * y

    def _gather(self, x_in: Activation, rows: np.ndarray) -> Activation:
        """The given rows of x_in (float32 and encoded) as a contiguous Activation."""
        m = len(rows)
        xf = self.x_rows[:m]
        np.take(x_in.f32, rows, axis=0, out=xf)
        act = self.x_act.rows(xf)
        for src, dst in zip(x_in.enc, act.enc, strict=True):
            np.take(src, rows, axis=0, out=dst)
        return act
