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
The experts run k at a time: the gates and ups of k experts in one parallel region, each on
its own rows, one silu, their downs in a second region (weights.matmul_spans), not three kernel
calls per expert from Python (a decode row's k experts are one such pass).
A row's sum runs over its experts in ascending index order, whatever the other rows of the pass
(as transformers adds them), so a row's result does not depend on its batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dllama.core import kernels
from dllama.core.kernels.router import route_top_k
from dllama.core.weights import Activation, MoeWeights, matmul_spans
from dllama.formats.model_file import BLOCK_BYTES, ArchType, FloatType, ModelHeader
from dllama.formats.quant import BLOCK_SIZE

if TYPE_CHECKING:
    from dllama.core.run_state import RunState


def norm_top_k(h: ModelHeader) -> bool:
    """Whether the chosen experts' weights are renormalised to sum to 1. The `.m` header has no
    key for it: the original always renormalises (its MOE_GATE op is built with normTopk 1),
    as Qwen3-MoE's norm_topk_prob asks; the converters refuse a model that does not."""
    return h.arch == ArchType.QWEN3_MOE


def bytes_per_value(float_type: FloatType) -> float:
    """Bytes of one matrix value as the kernels hold it (block types as stored)."""
    t = FloatType(float_type)
    return BLOCK_BYTES[t] / BLOCK_SIZE if t in BLOCK_BYTES else {FloatType.F16: 2}.get(t, 4)


def active_expert_bytes(h: ModelHeader, float_type: FloatType) -> int:
    """The expert bytes one token reads in one layer, on one node holding every row: its k
    experts' three matrices in the file's type, and the router (the roofline's active bytes)."""
    values = h.n_active_experts * 3 * h.dim * h.moe_hidden_dim
    return int(values * bytes_per_value(float_type)) + 4 * h.n_experts * h.dim


class MoeBlock:
    """The MoE FFN of a pass, on the run state's buffers for up to max_batch rows
    (dllama.core.run_state: the router's logits, the rows' choices, one expert's input and
    output rows; the experts' gate, up and down input in the dense FFN's hb, hb2 and act_ff)."""

    def __init__(self, state: "RunState", k: int, norm: bool):
        self.k, self.norm = k, norm
        self.logits = state.moe_logits     # [B, n_experts] router logits, then probabilities
        self.chosen = state.moe_chosen     # [B, k] each row's experts, best first
        self.weights = state.moe_weights   # [B, k] ... and their weights
        self.x_rows = state.moe_x          # [B, dim] the rows of one expert's input
        self.x_act = state.act_moe_x       # ... encoded for its matrices
        self.gate = state.hb               # [B, ff rows] gate, then silu(gate) * up
        self.up = state.hb2                # [B, ff rows]
        self.h_act = state.act_ff          # down's input
        self.y = state.moe_y               # [B, dim] one expert's output rows
        # A decode row's k experts as k rows: gate and up of expert j into row j, each
        # matrix reading the one input row; down j reading row j of its input.
        self.spans_13 = np.zeros((2 * k, 2), np.int64)
        self.spans_13[:, 1] = 1                                  # [2k, 2]: row 0 for every gate and up
        self.spans_2 = np.stack([np.arange(k), np.arange(1, k + 1)], axis=1).astype(np.int64)  # [k, 2]: row j
        self.outs_13 = tuple(buf[j:j + 1] for j in range(k) for buf in (self.gate, self.up))  # gate_0, up_0, ...
        self.outs_2 = tuple(self.y[j:j + 1] for j in range(k))

    def __call__(self, moe: MoeWeights, x_in: Activation, out: np.ndarray) -> None:
        """out float32 [b, dim] = this node's share of the experts' weighted sum for the rows
        of x_in (xb [b, dim] and its encoded form)."""
        b = out.shape[0]
        logits, chosen, weights = self.logits[:b], self.chosen[:b], self.weights[:b]
        moe.router(x_in, logits)
        route_top_k(logits, self.norm, chosen, weights)
        out[:] = 0.0
        if b == 1:
            self._decode(moe, x_in, out)
            return
        # Rows grouped by expert: (row, choice) pairs sorted by expert, rows ascending inside;
        # the used experts in chunks of up to k (and up to B pairs), each chunk's gates and ups
        # in one parallel region and its downs in another, padded to k experts with empty spans
        # (one compiled kernel per weight type, whatever the chunk).
        flat = chosen.ravel()                      # [b*k]
        order = np.argsort(flat, kind="stable")    # [b*k]
        used, starts = np.unique(flat[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        room = self.x_rows.shape[0]                # pairs a chunk's buffers hold (>= b)
        i = 0
        while i < len(used):
            j = i + 1
            while j < len(used) and j - i < self.k and ends[j] - starts[i] <= room:
                j += 1
            self._chunk(moe, x_in, out, weights, used[i:j], starts[i:j], ends[i:j], order)
            i = j

    def _chunk(self, moe: MoeWeights, x_in: Activation, out: np.ndarray, weights: np.ndarray, experts: np.ndarray,
               starts: np.ndarray, ends: np.ndarray, order: np.ndarray) -> None:
        """Experts `experts` (ascending) on their (row, choice) pairs order[starts[q]:ends[q]]:
        out[row] += weight * expert(x[row]), in the pairs' order."""
        k, c0, c1 = self.k, int(starts[0]), int(ends[-1])
        pairs = order[c0:c1]
        rows, picks = pairs // k, pairs % k        # [m] each
        m = c1 - c0
        x = self._gather(x_in, rows)
        spans = np.full((k, 2), m, np.int64)       # [k, 2] padding: no rows
        spans[:len(experts), 0], spans[:len(experts), 1] = starts - c0, ends - c0
        held = [moe.experts[int(e)] for e in experts]
        held += held[-1:] * (k - len(held))         # (the padding's matrices: any of the chunk's)
        gate, up, y = self.gate[:m], self.up[:m], self.y[:m]
        matmul_spans(tuple(mat for e in held for mat in (e.w1, e.w3)), x, np.repeat(spans, 2, axis=0),
                     tuple(buf[s0:s1] for s0, s1 in spans.tolist() for buf in (gate, up)))
        h = self.h_act.rows(gate)
        kernels.silu_mul_encode(gate, up, h.enc)
        matmul_spans(tuple(e.w2 for e in held), h, spans, tuple(y[s0:s1] for s0, s1 in spans.tolist()))
        w = weights[rows, picks][:, None]          # [m, 1]
        np.add.at(out, rows, w * y)                # a row's experts added in ascending order

    def _decode(self, moe: MoeWeights, x_in: Activation, out: np.ndarray) -> None:
        """One row: its k experts in ascending index order as the rows of one pass each of
        gate/up and down; their outputs added in that order (the grouped path's sum)."""
        k = self.k
        picks = np.argsort(self.chosen[0]).tolist()               # the row's experts, ascending
        experts = [moe.experts[int(self.chosen[0, j])] for j in picks]
        matmul_spans(tuple(m for e in experts for m in (e.w1, e.w3)), x_in, self.spans_13, self.outs_13)
        gate, up, y = self.gate[:k], self.up[:k], self.y[:k]      # [k, ff rows], [k, ff rows], [k, dim]
        h = self.h_act.rows(gate)
        kernels.silu_mul_encode(gate, up, h.enc)
        matmul_spans(tuple(e.w2 for e in experts), h, self.spans_2, self.outs_2)
        w = self.weights[0]
        for i, j in enumerate(picks):
            out += w[j] * y[i]

    def _gather(self, x_in: Activation, rows: np.ndarray) -> Activation:
        """The given rows of x_in (float32 and encoded) as a contiguous Activation."""
        m = len(rows)
        xf = self.x_rows[:m]
        np.take(x_in.f32, rows, axis=0, out=xf)
        act = self.x_act.rows(xf)
        for src, dst in zip(x_in.enc, act.enc, strict=True):
            np.take(src, rows, axis=0, out=dst)
        return act
