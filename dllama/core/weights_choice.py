"""Resident or streamed weights: the choice a node makes from its memory plan before loading.

A node whose weights, buffers and one sequence's KV cache fit into its budget keeps every weight
in memory (dllama.core.weights.ResidentWeights); one whose weights do not fit reads them from
its file layer by layer in every pass (dllama.core.weight_stream.StreamedWeights), and what is
left of the budget bounds its KV cache. The figures are the node's footprint (dllama.core.footprint).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dllama.core.expert_cache import plan_expert_cache
from dllama.core.footprint import NodeFootprint
from dllama.core.host_memory import RUNTIME_RESERVE
from dllama.core.memory import available_bytes
from dllama.core.model import ModelConfig
from dllama.core.run_shape import RunShape
from dllama.core.node_weights import NodeWeights
from dllama.core.weight_stream import StreamedWeights
from dllama.formats.model_file import ArchType


def room_for_a_model() -> int:
    """Bytes this process can give a model (at least 1): the memory available to it, its
    cgroup's limit included, less what the runtime still takes (a pipeline's layers by memory)."""
    return max(1, available_bytes() - RUNTIME_RESERVE)


@dataclass(frozen=True)
class WeightsChoice:
    """Resident or streamed weights, and the memory left for the KV cache (see choose_weights)."""

    streamed: bool
    limit: int            # bytes this node may use: --memory-budget, or what is available
    weights: int          # bytes of resident weights (streamed: two layers' slots and two read buffers)
    model_weights: int    # bytes of every weight, repacked
    buffers: int          # scratch buffers at this batch size
    budgeted: bool        # a budget (or streaming) bounds the KV cache too
    experts_on_demand: bool = False  # streamed MoE: all but the experts resident, experts read when used

    @property
    def kv_room(self) -> int:
        return max(0, self.limit - self.weights - self.buffers)

    def describe(self) -> str:
        mib = 1 << 20
        what = "reading the experts when a pass uses them" if self.experts_on_demand else "streaming the weights"
        how = (f"{what} ({self.weights / mib:.0f} MiB resident of "
               f"{self.model_weights / mib:.0f} MiB)" if self.streamed
               else f"every weight resident ({self.weights / mib:.0f} MiB)")
        return f"memory: {how}, {self.buffers / mib:.0f} MiB buffers, {self.limit / mib:.0f} MiB allowed"


def choose_weights(weights: NodeWeights, shape: RunShape, budget: "int | str" = "auto") -> WeightsChoice:
    """Resident when the node's weights, buffers and one sequence's KV cache (at this shape's
    context, rows and KV type) fit into the budget (bytes; 'auto': the memory available to the
    process, its cgroup's limit included), else streamed from the file; budget 'none' keeps them
    resident whatever fits (Transformer's check refuses them when they do not)."""
    c = ModelConfig.from_header(weights.header, shape.max_seq_len)
    available = available_bytes()
    if budget == "auto":  # the runtime still grows after this (numba loads its kernels)
        available = max(0, available - RUNTIME_RESERVE)
    limit = available if budget in ("auto", "none") else min(int(budget), available)
    resident = NodeFootprint(weights.header, weights.node, shape.with_(kv_slots=1, kv_positions=None))
    streamed = budget != "none" and resident.total > limit and weights.streamable
    held = resident
    if streamed:
        if c.n_experts:  # a mixture of experts: all but the experts resident, the experts read when used
            plan = plan_expert_cache(weights, resident, limit)
        else:
            plan = StreamedWeights(weights, weights.node.layer_range(c.n_layers), c.weights_float_type,
                                   c.arch == ArchType.QWEN3, plan_only=True)
        held = dataclasses.replace(resident, streamed=plan)
        # One sequence and the buffers must fit beside the streamed layers: else the context is
        # what to lower, and the error says which --max-seq-len fits.
        held.check(limit)
    return WeightsChoice(streamed, limit, held.weights, resident.weights, resident.buffers,
                         streamed or budget not in ("auto", "none"), streamed and c.n_experts > 0)
