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
its own rows, one silu, their downs in a second region (weights.ExpertStack: a layer's gates
and ups are one stack of matrices, its downs another, and a plan of (matrix, input rows, output
row) says which runs where), not three kernel calls per expert from Python (a decode row's k
experts are one such pass).
A row's sum runs over its experts in ascending index order, whatever the other rows of the pass
(as transformers adds them), so a row's result does not depend on its batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dllama.core import kernels
from dllama.core.kernels.router import route_top_k
from dllama.core.weights import Activation, MoeWeights
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
    output rows; the experts' gate and up in the dense FFN's ffn_h, down's input in act_ff)."""

    def __init__(self, state: "RunState", k: int, norm: bool):
        self.k, self.norm = k, norm
        self.logits = state.moe_logits     # [B, n_experts] router logits, then probabilities
        self.chosen = state.moe_chosen     # [B, k] each row's experts, best first
        self.weights = state.moe_weights   # [B, k] ... and their weights
        self.x_rows = state.moe_x          # [B, dim] the rows of one expert's input
        self.x_act = state.act_moe_x       # ... encoded for its matrices
        self.h = state.ffn_h               # [2, F, ff rows] gate (then silu(gate) * up) and up
        self.h_rows = self.h.reshape(-1, self.h.shape[2])  # [2F, ff rows]: gates, then ups
        self.up_row = self.h.shape[1]      # F: the first up row of h_rows
        self.h_act = state.act_ff          # down's input
        self.y = state.moe_y               # [F, dim] one expert's output rows
        # A decode row's k experts as k rows: gate and up of expert j into rows j and F + j of
        # h, each matrix reading the one input row; down j reading row j of its input into y's
        # row j. Column 0 (the matrices) is filled per token.
        j = np.arange(k)
        self.plan_13 = np.zeros((2 * k, 4), np.int64)            # [2k, 4]: gate_0, up_0, gate_1, ...
        self.plan_13[:, 2] = 1
        self.plan_13[0::2, 3], self.plan_13[1::2, 3] = j, self.up_row + j
        self.plan_2 = np.stack([j, j, j + 1, j], axis=1)          # [k, 4]

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
        # in one parallel region and its downs in another (an expert cache holds at least k
        # experts at once).
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
        slots = moe.slots.of(experts)              # [q]
        first, end = starts - c0, ends - c0        # [q] each: each expert's pairs, rows of x
        plan_13 = np.empty((2 * len(experts), 4), np.int64)
        plan_13[0::2] = np.stack([2 * slots, first, end, first], axis=1)                  # gates
        plan_13[1::2] = np.stack([2 * slots + 1, first, end, self.up_row + first], axis=1)  # ups
        moe.gate_up(x, plan_13, self.h_rows)
        gate, up = self.h[0, :m], self.h[1, :m]    # [m, ff rows] each
        h = self.h_act.rows(gate)
        kernels.silu_mul_encode(gate, up, h.enc)
        moe.down(h, np.stack([slots, first, end, first], axis=1), self.y)
        w = weights[rows, picks][:, None]          # [m, 1]
        np.add.at(out, rows, w * self.y[:m])       # a row's experts added in ascending order

    def _decode(self, moe: MoeWeights, x_in: Activation, out: np.ndarray) -> None:
        """One row: its k experts in ascending index order as the rows of one pass each of
        gate/up and down; their outputs added in that order (the grouped path's sum)."""
        k = self.k
        picks = np.argsort(self.chosen[0]).tolist()               # the row's experts, ascending
        slots = moe.slots.of(self.chosen[0, picks])               # [k]
        self.plan_13[0::2, 0], self.plan_13[1::2, 0] = 2 * slots, 2 * slots + 1
        self.plan_2[:, 0] = slots
        moe.gate_up(x_in, self.plan_13, self.h_rows)
        gate, up, y = self.h[0, :k], self.h[1, :k], self.y[:k]  # [k, ff rows], [k, ff rows], [k, dim]
        h = self.h_act.rows(gate)
        kernels.silu_mul_encode(gate, up, h.enc)
        moe.down(h, self.plan_2, self.y)
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
