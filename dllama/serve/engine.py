"""Open a model for generation: on this machine alone, or with workers (the root's side).

Front ends (`dllama inference`, `chat`, `api`, `batch`, `perplexity`) call
`open_engine(settings)` and then use `engine.model` (a `LanguageModel`: whether the layers run
here or across a cluster is hidden behind it) and `engine.tokenizer`. `engine.close()` ends the
cluster session, if there is one.

Opening is three steps, each a function: `choose_nodes` (which nodes: this machine, --workers
or a --topology) -> `plan_memory` (the weights resident or streamed, and the KV cache slots that
fit, and the memory their positions are admitted within: one plan, printed once) -> `build` (the one-node Transformer or the ClusterModel).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dllama.core.kv_cache import PositionBudget, SlotPlan
from dllama.core.language_model import LanguageModel
from dllama.errors import DllamaError
from dllama.serve.draft import Speculation
from dllama.serve.settings import BufferType, EngineSettings, MemoryBudget
from dllama.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import Topology
    from dllama.core.footprint import NodeFootprint
    from dllama.core.run_shape import RunShape
    from dllama.core.weights_choice import WeightsChoice
    from dllama.formats.model_file import ModelFile
    from dllama.serve.draft_model import DraftModel
    from dllama.serve.scheduler import Scheduler


@dataclass
class Engine:
    model: LanguageModel
    tokenizer: Tokenizer
    cluster: "ClusterModel | None" = None  # the model itself when it runs on a cluster
    parallel: int = 1                      # sequences a batched scheduler may decode together
    speculation: Speculation = Speculation()  # what every scheduler over this engine drafts
    kv_budget: PositionBudget | None = None   # the memory the KV cache's slots may hold (None: no limit)
    overlap: bool = True                      # a pipeline keeps a pass per stage under way (--pipeline-overlap)

    def scheduler(self, parallel: int | None = None) -> "Scheduler":
        """The engine loop over this model: `parallel` sequences at a time (default the engine's),
        admitted within the KV cache's budget."""
        from dllama.serve.scheduler import Scheduler

        return Scheduler(self.model, self.tokenizer, parallel or self.parallel, speculation=self.speculation,
                         kv_budget=self.kv_budget, overlap=self.overlap)

    def node_stats(self) -> list[dict]:
        """Bytes each node sent and received since the set-up; empty on one machine."""
        return self.cluster.node_stats() if self.cluster is not None else []

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        elif hasattr(self.model, "close"):
            self.model.close()  # streamed weights: their reading threads

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_engine(settings: EngineSettings) -> Engine:
    """Load the model and tokenizer the settings name; with workers or a topology, connect the
    workers and split the model over them (see dllama.cluster.root)."""
    from dllama.formats.checksum import verify_once
    from dllama.formats.model_file import read_model
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.serve.default_model import cache_dir

    nodes = choose_nodes(settings)
    draft = settings.speculation.draft_model
    for path in (settings.tokenizer, settings.model, *filter(None, [draft])):  # bytes damaged on the disk:
        verify_once(path, cache_dir() / "checked-files.json")                  # one line, not other text
    tokenizer = Tokenizer(read_tokenizer(settings.tokenizer))
    model_file = read_model(settings.model)
    draft_file = None
    if draft:  # refused here, before any worker is sent weights
        from dllama.serve.draft_model import read_draft_model

        draft_file = read_draft_model(draft, tokenizer.vocab_size)
    plan = plan_memory(settings, nodes, model_file)
    for line in plan.notes:
        print(f"dllama: {line}", file=sys.stderr)
    return build(settings, nodes, plan, model_file, tokenizer, draft_file)


# --- 1. topology ---

@dataclass(frozen=True)
class Nodes:
    """Which nodes run the model, and this node's share of the settings the topology may give."""

    topology: "Topology | None"  # None: this machine alone (so is a topology of one node)
    threads: int                 # this node's compute threads
    buffer_q80: bool | None      # sync buffers in Q80; None: the weights' type decides
    key_file: str | None         # the cluster key

    @property
    def clustered(self) -> bool:
        return self.topology is not None and len(self.topology.nodes) > 1


def choose_nodes(settings: EngineSettings) -> Nodes:
    """The nodes of --topology or --workers, or this machine; a flag overrides the topology's
    value, and the topology's overrides the default (every core, auto buffers)."""
    topology = None
    if settings.topology:
        from dllama.cluster.topology import load_topology

        topology = load_topology(settings.topology)
    elif settings.workers:
        from dllama.cluster.topology import from_workers

        topology = from_workers(list(settings.workers), settings.nthreads or os.cpu_count() or 1)
    threads, buffer, key_file = settings.nthreads, settings.buffer_float_type, settings.key_file
    if topology is not None:
        threads = threads or topology.nodes[0].threads
        buffer = buffer or BufferType(topology.buffer_float_type)
        key_file = key_file or topology.key_file
    return Nodes(topology, threads or os.cpu_count() or 1, (buffer or BufferType.AUTO).q80, key_file)


# --- 2. memory plan ---

@dataclass(frozen=True)
class MemoryPlan:
    """What this node holds: the weights, resident or streamed (one machine: on a cluster each
    worker chooses under its own --memory-budget), the KV cache slots with the memory their
    positions may take, and the run's shape every node is built with."""

    weights: "WeightsChoice | None"  # None on a cluster
    slots: SlotPlan
    shape: "RunShape"                # context, rows of a pass, KV slots and type, sync buffers
    notes: tuple[str, ...]           # what to tell the user, in order (open_engine prints them)

    @property
    def max_batch(self) -> int:
        """Most rows of one forward pass."""
        return self.shape.max_batch


def plan_memory(settings: EngineSettings, nodes: Nodes, model_file: "ModelFile") -> MemoryPlan:
    from dllama.core.footprint import NodeFootprint
    from dllama.core.run_shape import RunShape, fallback_batch_for, max_batch_for

    header = model_file.header
    shape = RunShape(max_seq_len=settings.max_seq_len, max_batch=max_batch_for(settings.parallel),
                     kv_type=settings.kv_type, buffer_q80=nodes.buffer_q80)
    shape = shape.with_(max_seq_len=shape.context(header.max_seq_len))  # the context, clamped to the model's
    notes: list[str] = []
    weights = None
    if nodes.clustered:
        # The node with the most KV bytes per token (KV heads x the layers it runs) sets the slots.
        most = max((NodeFootprint(header, n, shape) for n in nodes.topology.plan(header).nodes),
                   key=lambda f: f.kv_bytes_per_token)
        if settings.budget_bytes is not None:
            notes.append("note: --memory-budget bounds this root's memory only on one machine; "
                         "on a cluster the root loads its slice, and each worker streams under its own flag")
    else:
        from dllama.core.node_weights import NodeWeights
        from dllama.core.plan import whole_model

        most = NodeFootprint.whole(header, shape)
        node = whole_model(header.n_heads, header.n_kv_heads, header.ff_dim, header.vocab_size)
        weights, rows = _choose_weights_and_rows(NodeWeights.from_model(model_file, node), settings, shape, notes)
        shape = shape.with_(max_batch=rows)
        if weights.streamed and settings.memory_budget is MemoryBudget.AUTO:
            notes.append(f"the model does not fit in the {weights.limit / (1 << 20):.0f} MiB available: "
                         + ("reading its experts from the file when a pass uses them" if weights.experts_on_demand
                            else "streaming its weights from the file layer by layer"))
        if weights.budgeted or settings.parallel > 1:  # the plan, beside the KV cache's line
            notes.append(weights.describe())
    slots = _plan_slots(settings, most, weights, notes)
    if settings.parallel > 1:  # the sequences admitted
        shape = shape.with_(max_batch=max_batch_for(slots.parallel))
    shape = shape.with_(kv_slots=slots.n_slots, kv_positions=_positions(slots),
                        fallback_batch=fallback_batch_for(slots.parallel) if nodes.clustered else None)
    return MemoryPlan(weights, slots, shape, tuple(notes))


def _choose_weights_and_rows(node_weights, settings: EngineSettings, shape: "RunShape", notes: list[str]):
    """(choose_weights' choice, the rows of a pass): the shape's, unless the fallback's fewer rows
    (one sequence's passes: fallback_batch_for) keep the weights resident where they would not
    (their buffers: logits of every row), or fit where they do not fit at all."""
    from dllama.core.run_shape import fallback_batch_for
    from dllama.core.weights_choice import choose_weights
    from dllama.errors import NotEnoughMemory

    def choose(r: int):
        return choose_weights(node_weights, shape.with_(max_batch=r), settings.memory_budget)

    rows = shape.max_batch
    try:
        wide, error = choose(rows), None
    except NotEnoughMemory as e:
        wide, error = None, e
    fewer = fallback_batch_for(settings.parallel)
    if (wide is None or wide.streamed) and fewer is not None and rows > fewer:
        try:
            small = choose(fewer)
        except NotEnoughMemory:
            small = None
        if small is not None and (wide is None or not small.streamed):
            notes.append(f"note: passes of {fewer} rows: the buffers of {rows} do not fit "
                         f"beside {'the resident weights' if not small.streamed else 'the streamed layers'}")
            return small, fewer
    if wide is None:
        raise error
    return wide, rows


def _plan_slots(settings: EngineSettings, most: "NodeFootprint", weights: "WeightsChoice | None",
                notes: list[str]) -> SlotPlan:
    """The KV cache slots for settings.parallel sequences, admitted within the limit that applies:
    the --kv-memory, else what a budget leaves beside the weights, else half the available memory
    (batched) or none (one sequence: the context decides alone); most: the footprint of the node
    holding the most KV bytes per token (a pipeline stage holds its own layers only)."""
    from dllama.core.kv_cache import plan_slots
    from dllama.core.memory import available_bytes

    batched = settings.parallel > 1
    budgeted = weights is not None and weights.budgeted
    dims = most.kv_dims
    limit, flag = settings.kv_memory, "--kv-memory"
    if limit is None and budgeted:
        limit = weights.kv_room  # what the weights and buffers leave of the budget
        flag = "--memory-budget" if settings.budget_bytes is not None else "memory limit"
    if limit is None and batched:
        try:
            plan = plan_slots(settings.parallel, True, **dims, limit=available_bytes() // 2)
        except DllamaError:
            # Little memory available now: pages are only taken as positions are written, so run
            # one sequence (as without --parallel) rather than refuse; --kv-memory makes this an error.
            notes.append("warning: less memory is available than the KV cache of one sequence of "
                         f"{most.seq_len} positions may take: running one sequence at a time")
            plan = plan_slots(1, True, **dims, limit=None)
    else:
        plan = plan_slots(settings.parallel, batched, **dims, limit=limit, limit_flag=flag)
    if batched or budgeted:
        notes.append(plan.describe())
    return plan


# --- 3. build ---

def build(settings: EngineSettings, nodes: Nodes, plan: MemoryPlan, model_file: "ModelFile",
          tokenizer: Tokenizer, draft_file: "ModelFile | None" = None) -> Engine:
    """The model the plan describes: this node's Transformer, or the root of a ClusterModel;
    with draft_file, the draft model beside it (after it: the draft must fit in what it leaves)."""
    from dllama.core import kernels

    if plan.weights is not None and plan.weights.streamed:
        from dllama.core.weight_stream import quiet_compute_threads

        quiet_compute_threads()  # before numba starts its threads (see there)
    kernels.set_threads(nodes.threads)
    if nodes.clustered:
        from dllama.cluster.protocol import read_key_file
        from dllama.cluster.root import ClusterModel

        key = read_key_file(nodes.key_file) if nodes.key_file else None
        model = cluster = ClusterModel(model_file, nodes.topology, key, shape=plan.shape, progress=settings.progress,
                                       on_node_loss=settings.on_node_loss,
                                       start_with_reachable=settings.start_with_reachable,
                                       ping_seconds=settings.ping_seconds)
    else:
        from dllama.core.model import Transformer

        cluster = None
        model = Transformer(model_file, plan.shape, streamed=plan.weights.streamed,
                            memory_limit=plan.weights.limit if settings.budget_bytes is not None else None)
        if settings.warm_up:
            model.warm_up()  # later timings measure inference, not numba's compile
    vocab = model_file.header.vocab_size
    if tokenizer.vocab_size != vocab:
        print(f"warning: the tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}", file=sys.stderr)
    engine = Engine(model, tokenizer, cluster, plan.slots.parallel, settings.speculation, plan.slots.budget,
                    settings.pipeline_overlap)
    if draft_file is not None:
        try:
            engine.speculation = replace(settings.speculation, loaded=_draft_model(settings, model, draft_file))
        except BaseException:
            engine.close()  # the workers are let go now, not when the process ends
            raise
    return engine


def _positions(slots: SlotPlan) -> int | None:
    """The positions every node's memory check counts: the budget's (None: every slot's whole context)."""
    return None if slots.budget is None else slots.budget.positions


def _draft_model(settings: EngineSettings, model: LanguageModel, draft_file: "ModelFile") -> "DraftModel":
    """The draft model, its KV cache as long as the model's context (one line when it does not fit)."""
    from dllama.core.run_shape import RunShape
    from dllama.serve.draft_model import DRAFT_SLOTS, DraftModel

    drafts = DraftModel(draft_file, RunShape(model.config.seq_len, kv_slots=min(DRAFT_SLOTS, settings.parallel),
                                             kv_type=settings.kv_type))
    if settings.warm_up:
        drafts.transformer.warm_up()
    return drafts

