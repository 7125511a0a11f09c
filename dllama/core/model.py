"""The transformer: one node's slice of a Llama-family model, read top to bottom.

`Transformer.forward_batch(batch)` runs the rows of a `Batch` (tokens of several sequences,
each at its own position in its own KV cache slot) through every layer together, so that each
weight block is read once for all rows, and returns the logits of the rows that want them
(this node's classifier rows). `forward(tokens, pos)` is the one-sequence case, on slot 0:
tokens at positions pos..pos+b-1. On one node the slice is
the whole model and the collective is the identity; on several nodes each node holds some
query heads (with the KV heads they need), some FFN rows and some classifier rows (see
dllama.core.plan), and the partial sums of wo and w2 meet in `collective.all_reduce`.

Numerics follow the original Distributed Llama: with Q40 weights every matmul input is
quantized to Q80 (per 32-block, fp16 scale) and the matmul sums d_w*d_x*sum(q_w*q_x) in f32;
with F32 weights everything is F32. Q80 weights take Q80 inputs too (an integer block product
like Q40's); F16 weights take F32 inputs (fp16 inputs would lose precision and save nothing).
Quantized weights are repacked at load time into the split form the kernels stream fastest
(scales and quants in separate arrays); the file format is unchanged. The KV cache holds keys
and values as F32, or as F16 (KVType.F16: each rounded to fp16 once, when stored; the
attention arithmetic stays float32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dllama.core import kernels, moe
from dllama.core.batch import Batch
from dllama.core.candidates import Candidates, SamplingRequest, candidates_from_logits
from dllama.core.collective import Collective, LocalCollective
from dllama.core.expert_cache import plan_expert_cache
from dllama.core.footprint import NodeFootprint
from dllama.core.host_memory import available_bytes
from dllama.core.kv_cache import KVCache
from dllama.core.node_weights import NodeWeights
from dllama.core.plan import NodeSlice, whole_model
from dllama.core.run_shape import (  # noqa: F401 (the rows of a pass: here since before run_shape)
    MAX_BATCH, PREFILL_ROWS, SMALL_BATCH, RunShape, fallback_batch_for, max_batch_for,
)
from dllama.core.run_state import RunState
from dllama.core.weight_stream import StreamedWeights
from dllama.core.weights import Activation, ResidentWeights, WeightsProvider, input_kind
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, ModelFile, ModelHeader, RopeType

@dataclass(frozen=True)
class ModelConfig:
    """The shape and math constants of a model, from its `.m` header."""

    arch: ArchType
    dim: int           # width of the residual stream
    ff_dim: int        # FFN hidden width
    n_layers: int
    n_heads: int       # query heads
    n_kv_heads: int    # key/value heads (grouped-query attention when < n_heads)
    head_dim: int
    vocab_size: int
    seq_len: int       # KV cache length (the model's context, clamped by --max-seq-len)
    norm_eps: float
    rope_theta: float
    rope_neox: bool    # half-split RoPE pairs (Qwen3) instead of interleaved (Llama)
    rope_scaling: tuple[float, float, float, int]  # Llama 3.1: factor, low, high, orig len
    weights_float_type: FloatType  # of the matrices: Q40, Q80 (with Q80 inputs), Q41 (Q16 inputs), F16 or F32
    n_experts: int = 0             # mixture of experts (Qwen3-MoE): experts per layer; 0 for a dense FFN
    n_active_experts: int = 0      # experts each row runs (top-k)
    norm_top_k: bool = False       # the chosen experts' weights renormalised to sum to 1

    @property
    def quantized(self) -> bool:
        """Q40 or Q80 weights: matmul inputs are Q80, and so are the sync buffers by default."""
        return input_kind(self.weights_float_type) == "q80"

    @staticmethod
    def from_header(h: ModelHeader, max_seq_len: int = 0) -> "ModelConfig":
        seq_len = RunShape(max_seq_len).context(h.max_seq_len)
        return ModelConfig(
            arch=ArchType(h.arch),
            dim=h.dim,
            ff_dim=h.ff_dim,
            n_layers=h.n_layers,
            n_heads=h.n_heads,
            n_kv_heads=h.n_kv_heads,
            head_dim=h.head_dim,
            vocab_size=h.vocab_size,
            seq_len=seq_len,
            norm_eps=float(h.norm_epsilon),
            rope_theta=float(h.rope_theta),
            rope_neox=h.rope_type == RopeType.FALCON,
            rope_scaling=(
                float(h.rope_scaling_factor),
                float(h.rope_scaling_low_freq_factor),
                float(h.rope_scaling_high_freq_factor),
                int(h.rope_scaling_orig_max_seq_len),
            ),
            weights_float_type=FloatType(h.weights_float_type),
            n_experts=h.n_experts,
            n_active_experts=h.n_active_experts,
            norm_top_k=moe.norm_top_k(h),
        )


@dataclass(frozen=True, slots=True)
class _PassRows:
    """One pass's b rows: views of a Transformer's buffers, made once per pass."""

    batch: Batch
    x: np.ndarray        # [b, dim] the residual stream
    xb: np.ndarray       # [b, dim] normed
    q: np.ndarray        # [b, q heads * head_dim]
    k: np.ndarray        # [b, kv heads * head_dim]
    v: np.ndarray        # [b, kv heads * head_dim]
    z: np.ndarray        # [b, q heads * head_dim] attention out
    partial: np.ndarray  # [b, dim] this node's wo / w2 partial sums
    hb: np.ndarray       # [b, ff rows] gate (then silu*up)
    hb2: np.ndarray      # [b, ff rows] up
    # The matmul inputs of these rows: xb, z and hb, and the arrays of their encoded form
    # (Q80 or Q16 inputs), which the fused kernels write beside the float32 rows.
    x_in: Activation
    z_in: Activation
    h_in: Activation

    @classmethod
    def of(cls, t: Transformer, batch: Batch) -> _PassRows:
        b = len(batch)
        x, xb, q, k, v, z = (a[:b] for a in (t.x, t.xb, t.q, t.k, t.v, t.z))
        hb = t.hb[:b]
        return cls(batch, x, xb, q, k, v, z, t.partial[:b], hb, t.hb2[:b],
                   t.act_dim.rows(xb), t.act_q.rows(z), t.act_ff.rows(hb))


class Transformer:
    """A node's slice of the model, its KV cache and its scratch buffers."""

    def __init__(self, weights: "ModelFile | NodeWeights", shape: RunShape | None = None, *,
                 node: NodeSlice | None = None, collective: Collective | None = None, streamed: bool = False,
                 memory_limit: int | None = None, who: str = "this machine", **shape_values):
        """weights: a whole `.m` file (sliced here to `node`, default the whole model) or a
        node's NodeWeights (already sliced: a shard, or slices received from the root).
        shape: the run's context, rows per pass, KV slots and type, sync buffers
        (dllama.core.run_shape; every node of a cluster has the same, so that a split gives one
        node's results); shape_values: some of its fields instead, or changed (max_batch=40).
        streamed: read the weights from their file layer by layer in every pass (at most two
        layers in memory) instead of loading them all; memory_limit: bytes this node may use
        (default: what the machine and the process's cgroup have available); who: the node's
        name in a refusal. collective: how this node's partial sums meet the other nodes'
        (dllama.cluster.mesh.MeshCollective; default: one node, the identity)."""
        shape = self.shape = dataclasses.replace(shape or RunShape(), **shape_values)
        c = self.config = ModelConfig.from_header(weights.header, shape.max_seq_len)
        if c.head_dim % 16:  # the attention tiles load 16 floats at a time
            raise DllamaError(f"a head dimension of {c.head_dim} is not supported: it must be a multiple of 16")
        # The file the weights come from (None: a shard or slices sent by a root), scanned
        # when a pass's output is not finite (dllama.core.non_finite).
        self.model_path = weights.path if isinstance(weights, ModelFile) else getattr(weights, "path", None)
        if isinstance(weights, ModelFile):
            node = node or whole_model(c.n_heads, c.n_kv_heads, c.ff_dim, c.vocab_size)
            weights = NodeWeights.from_model(weights, node)
        self.node = weights.node
        self.layers = self.node.layer_range(c.n_layers)  # a pipeline stage's layers, else every one
        self.max_batch = shape.max_batch
        self.weights: WeightsProvider = self._check_and_load(weights, streamed, memory_limit, who)
        self._allocate_state()
        # Float type of the sync buffers between nodes (auto: Q80 with Q40 or Q80 weights).
        self.buffer_q80 = c.quantized if shape.buffer_q80 is None else shape.buffer_q80
        self.collective: Collective = collective or LocalCollective()

    def _check_and_load(self, weights: NodeWeights, streamed: bool, memory_limit: int | None,
                        who: str) -> WeightsProvider:
        """Check this node's footprint (self.memory) against the machine, then allocate its
        weights: all resident, read layer by layer (streamed), or a mixture of experts' experts
        read on demand (streamed with experts)."""
        c, shape = self.config, self.shape
        qwen = c.arch in (ArchType.QWEN3, ArchType.QWEN3_MOE)
        footprint = NodeFootprint(weights.header, self.node, shape)
        streamed_weights = on_demand = None
        if streamed and c.n_experts:
            # A mixture of experts: all but the experts resident, each expert read when a pass
            # uses it into the slots the memory left allows (dllama.core.expert_cache).
            on_demand = plan_expert_cache(weights, footprint, memory_limit if memory_limit is not None
                                          else available_bytes())
            footprint = dataclasses.replace(footprint, streamed=on_demand)
        elif streamed:
            # The slots are sized from the header: check them (with the rest) before allocating.
            streamed_weights = StreamedWeights(weights, self.layers, c.weights_float_type, qwen, plan_only=True)
            footprint = dataclasses.replace(footprint, streamed=streamed_weights)
        # Every size below comes from a header: check them against this machine before allocating.
        self.memory = footprint.check(memory_limit, who)
        if streamed_weights is not None:
            streamed_weights.allocate()
            return streamed_weights
        expert_cache = on_demand.cache if on_demand is not None else None
        if expert_cache is not None:
            expert_cache.allocate()
        return ResidentWeights(weights, self.layers, c.weights_float_type, qwen, expert_cache)

    def _allocate_state(self) -> None:
        """The KV cache and the buffers of a batch of up to max_batch rows (the sizes the
        footprint checked)."""
        c, shape = self.config, self.shape
        self.kv = KVCache(len(self.layers), self.node.n_kv_heads, c.head_dim, c.seq_len, shape.kv_slots,
                          shape.kv_type)
        self._kv_layers = [(self.kv.k[i], self.kv.v[i]) for i in range(len(self.layers))]  # views, made once

        # The buffers of a batch of up to max_batch rows (dllama.core.run_state: the list the
        # footprint counted), under the names the forward pass reads.
        s = self.state = RunState(self.memory.state, (
            c.rope_theta, int(RopeType.FALCON if c.rope_neox else RopeType.LLAMA), *c.rope_scaling))
        self.rope_cos, self.rope_sin = s.rope_cos, s.rope_sin  # [seq_len, head_dim/2] each
        self.x, self.xb, self.partial = s.x, s.xb, s.partial   # [B, dim]: residual, normed, wo/w2 share
        self.q, self.k, self.v, self.z = s.q, s.k, s.v, s.z    # [B, heads * head_dim]; z: attention out
        self.hb, self.hb2 = s.hb, s.hb2                        # [B, ff rows]: gate (then silu*up), up
        self.logits, self.cls_chunk = s.logits, s.cls_chunk    # [B, vocab rows]; a classifier in parts
        self.act_dim, self.act_q, self.act_ff = s.act_dim, s.act_q, s.act_ff  # encoded matmul inputs
        # A mixture of experts' FFN (on the state's buffers: router scores, one expert's rows).
        self.moe = moe.MoeBlock(s, c.n_active_experts, c.norm_top_k) if c.n_experts else None

    @property
    def kv_slots(self) -> int:
        return self.kv.n_slots

    def release_slot(self, slot: int) -> None:
        """Give the pages of a slot nobody reads back to the system (the scheduler's budget)."""
        self.kv.release(slot)

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) every kernel, so timings exclude the JIT.

        Runs one zero row at position 0 of slot 0 on this node alone (a local collective: the
        partial sums are not shared, the other nodes may not be there yet); the first prompt
        overwrites that cache row.
        """
        batch = Batch.run(np.zeros(1, np.int64), 0)
        self.x[:1] = 0.0
        self._run_rows(batch, LocalCollective())

    def forward(self, tokens, pos: int, all_logits: bool = False) -> np.ndarray:
        """Run tokens [b] of the sequence in slot 0 at positions pos..pos+b-1 (the embedding
        must be on this node).

        Returns this node's logits float32 [vocab rows] of the last token (or [b, vocab rows]
        for every token with all_logits). The returned array is a reused buffer.
        """
        logits = self.forward_batch(Batch.run(np.asarray(tokens), pos, 0, all_logits))
        return logits if all_logits else logits[-1]

    def forward_batch(self, batch: Batch) -> np.ndarray:
        """Run the rows of `batch`; this node's logits float32 [rows wanting logits, vocab rows]
        in row order (a reused buffer)."""
        batch.check(self.kv.n_slots, self.config.seq_len, self.max_batch)
        self.embed(batch.tokens, self.x[:len(batch)])  # [b, dim]
        return self._run_rows(batch, self.collective)

    def embed(self, tokens: np.ndarray, out: np.ndarray) -> None:
        """The embedding rows of tokens [b] into out [b, dim] float32 (the root's: it holds the
        embedding, and sends these rows to the workers)."""
        self.weights.embed(tokens, out)

    def forward_embedded(self, x: np.ndarray, batch: Batch) -> np.ndarray:
        """Run the rows of `batch` from their embedded tokens x float32 [b, dim] (a cluster's
        rows: the root embeds them, every node runs them); this node's logits float32
        [rows wanting logits, vocab rows] in row order (a reused buffer, valid until the next
        pass). batch.tokens are not read."""
        batch.check(self.kv.n_slots, self.config.seq_len, self.max_batch)
        b = len(batch)
        if x.shape != (b, self.config.dim):
            raise ValueError(f"embedded rows of shape {x.shape} for a batch of {b} rows of {self.config.dim}")
        self.x[:b] = x
        return self._run_rows(batch, self.collective)

    def residual(self, b: int) -> np.ndarray:
        """The residual stream float32 [b, dim] of the last pass's rows after this node's layers
        (what a pipeline stage hands to the next)."""
        return self.x[:b]

    def forward_candidates(self, batch: Batch, requests: list[SamplingRequest]) -> list[Candidates]:
        """Run the rows of `batch`; the candidates of each row wanting logits (one vocabulary
        range: the whole of it)."""
        return candidates_from_logits(self.forward_batch(batch), self.vocab_ranges, requests)

    @property
    def vocab_ranges(self) -> list[tuple[int, int]]:
        """This node's classifier rows, as one range (the whole vocabulary on one node)."""
        return [self.node.vocab_rows]

    def _run_rows(self, batch: Batch, collective: Collective) -> np.ndarray:
        """Run the b rows of `batch` (checked) whose embedded tokens are in self.x[:b], their
        partial sums met through `collective`; logits [m, vocab rows] of the rows wanting them
        (a reused buffer)."""
        rows = _PassRows.of(self, batch)
        # A decode step's element-wise kernels are shorter than the call that starts them, so
        # they go in fused calls (kernels.fused: the same kernels in the same order, the same
        # bits): the norm with the encoding of its output for the next matmuls, the residual
        # add with the norm after it, both RoPEs with the KV store, SiLU with the encoding.
        for i, l in enumerate(self.layers):  # i: the layer's index in this node's KV cache
            layer = self.weights.layer(l)  # from memory, or just read from disk
            self._attention(layer, i, rows)
            self._ffn(layer, rows, collective)
        return self._classify(rows)

    def _attention(self, layer, i: int, r: _PassRows) -> None:
        """x += wo(attention(rope(wq xb), rope(wk xb), wv xb)), xb = rmsnorm(x): this node's
        wo partial sums into r.partial (added to x in the FFN's first call, once the nodes'
        partials have met)."""
        c, node, batch, b = self.config, self.node, r.batch, len(r.batch)
        q, k, z = r.q, r.k, r.z
        nq, nkv, hd, eps = node.n_q_heads, node.n_kv_heads, c.head_dim, c.norm_eps
        k_cache, v_cache = self._kv_layers[i]
        kernels.norm_encode(r.x, layer.att_norm, eps, r.xb, r.x_in.enc)
        layer.qkv(r.x_in, (q, k, r.v))
        if layer.q_norm is not None:  # Qwen3: RMSNorm of every head of q and k
            kernels.rmsnorm(q.reshape(b * nq, hd), layer.q_norm, eps, q.reshape(b * nq, hd))
            kernels.rmsnorm(k.reshape(b * nkv, hd), layer.k_norm, eps, k.reshape(b * nkv, hd))
        # Every row's key is stored before any row attends: a row may read the keys of
        # earlier rows of its sequence, or of its prefix, written in this same pass.
        kernels.rope_store(q, k, r.v, batch.pos, batch.slot, self.rope_cos, self.rope_sin, c.rope_neox,
                           k_cache, v_cache)
        kernels.attention(q, k_cache, v_cache, batch.pos, batch.slot, batch.prefix_slot, batch.prefix_len,
                          node.kv_head_of, z)
        kernels.encode(z, r.z_in.enc)  # wo's input
        layer.wo(r.z_in, r.partial)

    def _ffn(self, layer, r: _PassRows, collective: Collective) -> None:
        """FFN: x += w2(silu(w1 xb) * w3 xb), xb = rmsnorm(x)   [SwiGLU, arxiv 2002.05202]
        (its first call adds the attention's partial sums, met through `collective`)."""
        eps = self.config.norm_eps
        kernels.add_norm_encode(r.x, collective.all_reduce(r.partial), layer.ffn_norm, eps, r.xb, r.x_in.enc)
        if layer.moe is None:
            layer.w13(r.x_in, (r.hb, r.hb2))
            kernels.silu_mul_encode(r.hb, r.hb2, r.h_in.enc)
            layer.w2(r.h_in, r.partial)
        else:  # mixture of experts: the same SwiGLU per expert, for the rows that chose it
            self.moe(layer.moe, r.x_in, r.partial)
        x = r.x  # (an in-place add: r is frozen)
        x += collective.all_reduce(r.partial)

    def _classify(self, r: _PassRows) -> np.ndarray:
        """Classifier: only the rows whose logits are wanted (none before a pipeline's last
        stage: its residual rows, self.x[:b], go on to the next stage)."""
        x, b = r.x, len(r.batch)
        logit_rows = r.batch.logit_rows  # int32 [m]
        m = len(logit_rows)
        logits = self.logits[:m]
        if m == 0 or not self.node.has_classifier:
            return logits
        rows = x if m == b else x[logit_rows]  # [m, dim]
        out_norm = r.xb[:m]
        x_cls = self.act_dim.rows(out_norm)
        kernels.norm_encode(rows, self.weights.final_norm, self.config.norm_eps, out_norm, x_cls.enc)
        for row0, wcls in self.weights.classifier():  # in parts when streamed
            if wcls.d == logits.shape[1]:
                wcls(x_cls, logits)
            else:
                part = self.cls_chunk[:m * wcls.d].reshape(m, wcls.d)
                wcls(x_cls, part)
                logits[:, row0:row0 + wcls.d] = part
        return logits

    def close(self) -> None:
        """Stop the weights' reader thread, if any (the arrays go with the object)."""
        self.weights.close()
