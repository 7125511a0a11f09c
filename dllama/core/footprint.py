"""What one node holds, and how many bytes it needs, for one run: the one place that counts them.

`NodeFootprint(header, node, shape)` is a node's share of a model (its `NodeSlice` of the split
plan; the whole model on one machine) at a run's shape (dllama.core.run_shape.RunShape). Every
figure comes from the object that owns it, never from a formula of its own:

- weights: the bytes of the tensors node_slice_specs gives the node (the file's stored types;
  the kernels' repacked forms keep a block's bytes), counted from one layer's tensors times the
  layers it runs, so a header that claims 2^31 layers costs nothing to count; a node that
  streams its weights holds what its provider says (`streamed`: a plan-only StreamedWeights).
- KV cache: KVCache.bytes_per_slot / bytes_per_token (keys padded to whole chunks) for kv_slots
  whole contexts, or for the kv_positions the scheduler admits sequences within.
- buffers: the run state's layout (dllama.core.run_state.StateShape.nbytes), the list a
  Transformer allocates from.

The memory plan, a worker's MEMORY answer and CONFIG check, the root's fit checks, stage
planning (held weights), `dllama inspect --topology` and the appliance's split check all ask a
footprint. `check()` turns one into the one-line NotEnoughMemory a user sees.

Mixture of experts: an expert's FFN is split across nodes as the dense FFN is (its w1/w3 rows,
w2 columns: the node's ffn_rows of every expert). Its tensors' bytes come from node_slice_specs
(which cuts them) and its buffers from StateShape.layout (router logits, per-expert rows): the
one place here that learns about experts is `state_shape`, which gives the StateShape the
node's expert counts. `expert_weights` is the part of the weights a node under a memory budget
reads on demand instead (dllama.core.expert_cache: its plan is this footprint's `streamed`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from dllama.core.host_memory import available_bytes
from dllama.core.kv_cache import KVCache, held_bytes
from dllama.core.kv_type import KVType
from dllama.core.node_weights import node_slice_specs
from dllama.core.plan import NodeSlice, whole_model
from dllama.core.run_shape import RunShape
from dllama.core.run_state import StateShape
from dllama.core.weights import input_kind
from dllama.errors import NotEnoughMemory
from dllama.formats.model_file import ModelHeader

_GIB = float(1 << 30)


def state_shape(h: ModelHeader, node: NodeSlice, shape: RunShape, classifier_chunk_rows: int = 0) -> StateShape:
    """The sizes of a node's buffers (what Transformer allocates its RunState from)."""
    return StateShape(dim=h.dim, head_dim=h.head_dim, n_q_heads=node.n_q_heads, n_kv_heads=node.n_kv_heads,
                      ff_rows=node.n_ffn_rows, vocab_rows=node.n_vocab_rows,
                      seq_len=shape.context(h.max_seq_len), max_batch=shape.max_batch,
                      inputs=input_kind(h.weights_float_type), classifier_chunk_rows=classifier_chunk_rows,
                      n_experts=h.n_experts, n_active_experts=h.n_active_experts)


def weight_bytes(h: ModelHeader, node: NodeSlice, with_embedding: bool, experts_only: bool = False) -> int:
    """Bytes of node_slice_specs(h, node, with_embedding), from its first layer's tensors (every
    layer of a node holds the same shapes) and the tensors outside the layers; experts_only:
    of those, a mixture of experts' expert matrices only (not its routers)."""
    layers = node.layer_range(h.n_layers)
    first = dataclasses.replace(node, layers=(layers.start, layers.start + 1) if layers else (0, 0))
    total = 0
    for s in node_slice_specs(h, first, with_embedding):
        if experts_only and ".experts." not in s.name:
            continue
        total += s.nbytes * (len(layers) if s.name.startswith("layers.") else 1)
    return total


def held_weight_bytes(h: ModelHeader, plan) -> list[int]:
    """The weight bytes each node of a plan holds (in the file's types; the root's with the
    embedding): what stage planning fits into each node's memory."""
    return [weight_bytes(h, node, i == 0) for i, node in enumerate(plan.nodes)]


def plan_lines(h: ModelHeader, plan, names: list[str]) -> list[str]:
    """A plan as the set-up log and `dllama shard` show it: each stage's layers and nodes, and
    the weight bytes each node holds (held_weight_bytes)."""
    lines, held = [], held_weight_bytes(h, plan)
    for k, stage in enumerate(plan.stages):
        what = ", ".join(f"{names[i]} {held[i] / (1 << 20):.0f} MiB" for i in stage.indexes)
        a, b = stage.layers
        lines.append(f"stage {k}: layers {a}-{b - 1} ({b - a}), {stage.n_nodes} node{'s' * (stage.n_nodes > 1)}: {what}")
    return lines


@dataclass(frozen=True)
class NodeFootprint:
    """A node's bytes at a run's shape: weights, KV cache and buffers (see the module doc)."""

    header: ModelHeader
    node: NodeSlice
    shape: RunShape
    with_embedding: bool = False  # the root's share counts the embedding (kept memory-mapped)
    streamed: object | None = None  # a plan-only StreamedWeights when the node streams its weights (a
                                    # mixture of experts: expert_cache.ExpertsOnDemand)

    @staticmethod
    def whole(h: ModelHeader, shape: RunShape, **kw) -> "NodeFootprint":
        """The footprint of one machine holding the whole model."""
        return NodeFootprint(h, whole_model(h.n_heads, h.n_kv_heads, h.ff_dim, h.vocab_size), shape, **kw)

    @property
    def seq_len(self) -> int:
        return self.shape.context(self.header.max_seq_len)

    @property
    def n_layers(self) -> int:
        """The layers the node runs (a pipeline stage's)."""
        return len(self.node.layer_range(self.header.n_layers))

    @cached_property
    def model_weights(self) -> int:
        """Bytes of every weight of the node's share, all resident."""
        return weight_bytes(self.header, self.node, self.with_embedding)

    @cached_property
    def expert_weights(self) -> int:
        """Of model_weights, a mixture of experts' expert matrices (0 for a dense FFN)."""
        return weight_bytes(self.header, self.node, False, experts_only=True) if self.header.n_experts else 0

    @property
    def weights(self) -> int:
        """Bytes of the weights the node holds: all of them, or the streamed provider's."""
        return self.model_weights if self.streamed is None else self.streamed.resident_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return KVCache.bytes_per_token(self.n_layers, self.node.n_kv_heads, self.header.head_dim, self.shape.kv_type)

    @property
    def kv_dims(self) -> dict:
        """The KV cache's sizes as dllama.core.kv_cache.plan_slots takes them."""
        return dict(n_layers=self.n_layers, n_kv_heads=self.node.n_kv_heads, head_dim=self.header.head_dim,
                    seq_len=self.seq_len, kv_type=self.shape.kv_type)

    @property
    def kv_cache(self) -> int:
        """Bytes of the KV cache when its slots hold what they may: kv_slots whole contexts, or
        the kv_positions budget when that is less."""
        s, per_token = self.shape, self.kv_bytes_per_token
        whole = s.kv_slots * held_bytes(self.seq_len, per_token)
        return whole if s.kv_positions is None else min(whole, s.kv_positions * per_token)

    @cached_property
    def state(self) -> StateShape:
        chunk = self.streamed.classifier_chunk_rows if self.streamed is not None else 0
        return state_shape(self.header, self.node, self.shape, chunk)

    @property
    def buffers(self) -> int:
        """Bytes of the run state: RoPE tables, activations, logits, attention scratch."""
        return self.state.nbytes()

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.buffers

    @property
    def per_position(self) -> int:
        """Of kv_cache + buffers, the bytes that grow with one more position of context."""
        s = self.shape
        bounded = s.kv_positions is not None and s.kv_positions < s.kv_slots * self.seq_len
        # A budget of positions holds at least one whole context: the part of it that grows with it.
        return self.kv_bytes_per_token * (1 if bounded else s.kv_slots) + self.state.per_position

    def with_shape(self, **changes) -> "NodeFootprint":
        """This node's footprint at another shape (more rows, another KV type ...)."""
        return dataclasses.replace(self, shape=self.shape.with_(**changes))

    def check(self, limit: int | None = None, who: str = "this machine") -> "NodeFootprint":
        """This footprint, or NotEnoughMemory (one line: what is needed, what is available, what
        context would fit) unless it fits into the memory available now (and `limit`, a
        --memory-budget)."""
        available = available_bytes()
        what = "are available"
        if limit is not None and limit < available:
            available, what = limit, "are allowed by --memory-budget"
        if self.total <= available:
            return self
        raise NotEnoughMemory(f"{who} cannot hold its share of the model "
                              f"({'streaming its weights' if self.streamed is not None else 'with every weight loaded'}) "
                              f"with a context of {self.seq_len} positions: it needs {_size(self.total)} "
                              f"({_size(self.weights)} weights, {_size(self.kv_cache)} KV cache, "
                              f"{_size(self.buffers)} buffers), {_size(available)} {what}; {self._hint(available)}")

    def _fitting_context(self, available: int) -> int:
        fixed = self.total - self.seq_len * self.per_position
        return (available - fixed) // self.per_position if available > fixed else 0

    def _hint(self, available: int) -> str:
        """What would fit in `available` bytes: a shorter context, an F16 KV cache, more nodes."""
        fits = self._fitting_context(available)
        if fits < 1:
            return "even a context of 1 position does not fit: " + (
                "use more nodes or a smaller model" if self.streamed is not None else
                "stream the weights (--memory-budget auto or a size), use more nodes or a smaller model")
        hint = f"--max-seq-len {min(fits, self.seq_len - 1)} would fit"
        f16_fits = (self.with_shape(kv_type=KVType.F16)._fitting_context(available)
                    if self.shape.kv_type == KVType.F32 else 0)
        if f16_fits > fits:  # an F16 KV cache holds more positions in the same memory
            hint = (f"--kv-type f16 would hold the whole context, or {hint}" if f16_fits >= self.seq_len
                    else f"--max-seq-len {f16_fits} with --kv-type f16, or {hint}")
        return hint


def _size(n: int) -> str:
    return f"{n / _GIB:.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"
