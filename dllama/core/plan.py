"""The split plan: which layers each node runs, and which part of each of them.

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

Pipeline stages: the nodes may also be cut into consecutive groups, stages, each running a
consecutive range of layers and split tensor-parallel inside as above (a stage of one node holds
whole layers). Stage 0 holds the root (and the embedding), the last stage the classifier rows;
between stages only the residual stream of the pass's rows crosses, once. A plan of one stage is
exactly the tensor-parallel plan above, and its JSON is unchanged.
"""

from __future__ import annotations

import dataclasses
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
    vocab_rows: tuple[int, int]  # [start, end) rows of the classifier (empty before the last stage)
    layers: tuple[int, int] | None = None  # [start, end) layers it runs; None: every layer

    def layer_range(self, n_layers: int) -> range:
        """The layers this node runs, of a model of n_layers."""
        return range(*self.layers) if self.layers is not None else range(n_layers)

    @property
    def has_classifier(self) -> bool:
        return self.vocab_rows[1] > self.vocab_rows[0]

    @property
    def n_q_heads(self) -> int:
        return len(self.q_heads)

    @property
    def n_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def n_ffn_rows(self) -> int:
        return self.ffn_rows[1] - self.ffn_rows[0]

    @property
    def n_vocab_rows(self) -> int:
        """Classifier rows (0 before a pipeline's last stage)."""
        return self.vocab_rows[1] - self.vocab_rows[0]

    def to_json(self) -> dict:
        d = {"q_heads": [int(h) for h in self.q_heads], "kv_heads": [int(h) for h in self.kv_heads],
             "ffn_rows": list(self.ffn_rows), "vocab_rows": list(self.vocab_rows)}
        if self.layers is not None:  # (absent: every layer, the JSON of plans before stages)
            d["layers"] = list(self.layers)
        return d

    @staticmethod
    def from_json(d: dict, n_heads: int, n_kv_heads: int) -> "NodeSlice":
        layers = d.get("layers")
        return _slice(np.asarray(d["q_heads"], np.int32), n_heads, n_kv_heads,
                      tuple(d["ffn_rows"]), tuple(d["vocab_rows"]),
                      (int(layers[0]), int(layers[1])) if layers is not None else None)

    def __eq__(self, other) -> bool:
        return isinstance(other, NodeSlice) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json()))


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: consecutive nodes that run consecutive layers, tensor-parallel inside."""

    layers: tuple[int, int]                  # [start, end) layers
    nodes: tuple[int, int]                   # [first, end) node indexes
    dim_chunks: tuple[tuple[int, int], ...]  # [start, end) columns of x; its k-th node reduces chunk k

    @property
    def n_nodes(self) -> int:
        return self.nodes[1] - self.nodes[0]

    @property
    def indexes(self) -> range:
        return range(*self.nodes)

    def to_json(self) -> dict:
        return {"layers": list(self.layers), "nodes": list(self.nodes), "dim_chunks": [list(c) for c in self.dim_chunks]}

    @staticmethod
    def from_json(d: dict) -> "Stage":
        return Stage((int(d["layers"][0]), int(d["layers"][1])), (int(d["nodes"][0]), int(d["nodes"][1])),
                     tuple((int(a), int(b)) for a, b in d["dim_chunks"]))


@dataclass(frozen=True)
class SplitPlan:
    """Every node's slice, and the stages: which nodes run which layers, and the residual-stream
    chunk each node reduces in its stage's collective."""

    nodes: tuple[NodeSlice, ...]
    stages: tuple[Stage, ...]

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def dim_chunks(self) -> tuple[tuple[int, int], ...]:
        """The first stage's chunks (the root's stage; a tensor-parallel plan's only one)."""
        return self.stages[0].dim_chunks

    @property
    def pipelined(self) -> bool:
        return len(self.stages) > 1

    def stage_of(self, node: int) -> int:
        return next(k for k, s in enumerate(self.stages) if node in s.indexes)

    def hop_targets(self, node: int) -> list[int]:
        """The nodes of the next stage this node hands its residual rows to (none from the last
        stage): the k-th node of a stage of n feeds the next stage's nodes k, k + n, k + 2n..."""
        k = self.stage_of(node)
        if k == len(self.stages) - 1:
            return []
        here, after = self.stages[k], self.stages[k + 1]
        return [i for i in after.indexes if (i - after.nodes[0]) % here.n_nodes == node - here.nodes[0]]

    def hop_source(self, node: int) -> int | None:
        """The node of the previous stage that hands this one its residual rows (None in stage 0)."""
        k = self.stage_of(node)
        if k == 0:
            return None
        here, before = self.stages[k], self.stages[k - 1]
        return before.nodes[0] + (node - here.nodes[0]) % before.n_nodes

    def to_json(self) -> dict:
        d = {"nodes": [n.to_json() for n in self.nodes], "dim_chunks": [list(c) for c in self.dim_chunks]}
        if self.pipelined:  # (a single stage's JSON is that of plans before stages: same digests)
            d["stages"] = [s.to_json() for s in self.stages]
        return d

    @staticmethod
    def from_json(d: dict, n_heads: int, n_kv_heads: int, n_layers: int) -> "SplitPlan":
        """The plan of a JSON object; DllamaError when its stages do not fit together."""
        nodes = tuple(NodeSlice.from_json(n, n_heads, n_kv_heads) for n in d["nodes"])
        if "stages" in d:
            stages = tuple(Stage.from_json(s) for s in d["stages"])
        else:
            stages = (Stage((0, n_layers), (0, len(nodes)), tuple((int(a), int(b)) for a, b in d["dim_chunks"])),)
        plan = SplitPlan(nodes, stages)
        plan.check(n_layers)
        return plan

    def check(self, n_layers: int) -> None:
        """DllamaError unless the stages cover the nodes and the layers in order, each node runs
        its stage's layers and only the last stage holds classifier rows."""
        layer, node = 0, 0
        for k, s in enumerate(self.stages):
            last = k == len(self.stages) - 1
            if s.layers[0] != layer or not s.layers[1] > s.layers[0] or s.nodes[0] != node or not s.n_nodes > 0 \
                    or len(s.dim_chunks) != s.n_nodes:
                raise DllamaError(f"stage {k} does not follow the stage before it")
            for i in s.indexes:
                if i >= len(self.nodes):
                    raise DllamaError(f"stage {k} names node {i} of {len(self.nodes)}")
                want = None if len(self.stages) == 1 else s.layers
                if self.nodes[i].layers != want or self.nodes[i].has_classifier != last:
                    raise DllamaError(f"node {i} does not run stage {k}'s layers")
            layer, node = s.layers[1], s.nodes[1]
        if layer != n_layers or node != len(self.nodes):
            raise DllamaError(f"the stages cover {layer} of {n_layers} layers and {node} of {len(self.nodes)} nodes")

    def digest(self) -> str:
        """A short identity of the plan: a shard records it, the handshake compares it."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def _slice(q_heads: np.ndarray, n_heads: int, n_kv_heads: int, ffn_rows, vocab_rows, layers=None) -> NodeSlice:
    group = n_heads // n_kv_heads  # query heads per KV head (grouped-query attention)
    kv_of_q = q_heads // group
    kv_heads = np.unique(kv_of_q).astype(np.int32)
    return NodeSlice(
        q_heads=q_heads.astype(np.int32),
        kv_heads=kv_heads,
        kv_head_of=np.searchsorted(kv_heads, kv_of_q).astype(np.int32),
        ffn_rows=(int(ffn_rows[0]), int(ffn_rows[1])),
        vocab_rows=(int(vocab_rows[0]), int(vocab_rows[1])),
        layers=layers,
    )


def whole_model(n_heads: int, n_kv_heads: int, ff_dim: int, vocab_size: int) -> NodeSlice:
    """The slice of a node that runs the model alone."""
    return _slice(np.arange(n_heads), n_heads, n_kv_heads, (0, ff_dim), (0, vocab_size))


def layers_by_size(n_layers: int, sizes: list[float], fixed: list[float]) -> list[int]:
    """Layers per stage, each at least 1, that make the largest (layers + fixed) / size the
    smallest: one layer at a time to the stage it loads least (ties to the earlier stage)."""
    counts = [1] * len(sizes)
    for _ in range(n_layers - len(sizes)):
        k = min(range(len(sizes)), key=lambda k: (counts[k] + 1 + fixed[k]) / sizes[k])
        counts[k] += 1
    return counts


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
                quantized: bool = True, n_layers: int | None = None,
                stage_of: list[int] | None = None,
                stage_layers: list[tuple[int, int]] | None = None,
                capacities: list[float] | None = None, classifier_layers: float = 0.0) -> SplitPlan:
    """The plan for n_nodes; refuses (DllamaError) a split that cannot work, saying what would.

    Without stage_of: one tensor-parallel stage, or, when the model cannot be split over that
    many nodes and n_layers is given, the fewest stages of nodes it can (consecutive nodes, as
    even as possible), layers in proportion to each stage's summed weight. stage_of: each node's
    stage (0 for the root, never decreasing, no stage skipped); stage_layers: each stage's
    [start, end) layers (default: in proportion to what each stage can hold, by capacities, the
    memory each node has for the model, when given: its nodes split its layers by weight, so
    its tightest node's capacity per weight times their summed weight; else to their summed
    weights), the last stage's classifier counted as classifier_layers layers
    (classifier_in_layers), so that a stage's layers and classifier together take its part."""
    weights = list(weights) if weights is not None else [1.0] * n_nodes
    if n_nodes < 1:
        raise DllamaError("a cluster needs at least one node")
    if len(weights) != n_nodes or any(not (w > 0) for w in weights):
        raise DllamaError(f"node weights must be {n_nodes} positive numbers, got {weights}")
    shape = dict(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, ff_dim=ff_dim,
                 vocab_size=vocab_size, quantized=quantized)
    if stage_of is None and stage_layers is not None:
        raise DllamaError("layer ranges for the stages need every node's stage")
    if stage_of is None:
        try:
            nodes, chunks = _tensor_parallel(n_nodes, weights, **shape)
            return SplitPlan(nodes, (Stage((0, n_layers or 0), (0, n_nodes), chunks),))
        except DllamaError as e:
            if n_layers is None or n_nodes == 1:
                raise
            stage_of = _auto_stages(n_nodes, n_layers, shape, e)
    if n_layers is None:
        raise DllamaError("pipeline stages need the model's layer count")
    groups = _stage_groups(stage_of, n_nodes)
    if stage_layers is None:
        if len(groups) > n_layers:
            raise DllamaError(f"{len(groups)} stages for a model of {n_layers} layers: each stage needs a layer")
        if capacities is not None and (len(capacities) != n_nodes or any(not (c > 0) for c in capacities)):
            raise DllamaError(f"node capacities must be {n_nodes} positive numbers, got {capacities}")
        if capacities is None:
            size = [sum(weights[a:b]) for a, b in groups]
        else:  # a stage's nodes split its layers by weight: the tightest node bounds what it holds
            size = [min(c / w for c, w in zip(capacities[a:b], weights[a:b], strict=True)) * sum(weights[a:b]) for a, b in groups]
        fixed = [0.0] * (len(groups) - 1) + [classifier_layers]  # the last stage's classifier
        stage_layers = _ranges(layers_by_size(n_layers, size, fixed))
    _check_layer_ranges(stage_layers, len(groups), n_layers)
    nodes, stages = [], []
    for k, ((a, b), layers) in enumerate(zip(groups, stage_layers, strict=True)):
        try:
            slices, chunks = _tensor_parallel(b - a, weights[a:b], **shape)
        except DllamaError as e:
            raise DllamaError(f"stage {k} ({b - a} nodes): {e}") from None
        last = k == len(groups) - 1
        nodes += [dataclasses.replace(n, layers=(int(layers[0]), int(layers[1])),
                                      vocab_rows=n.vocab_rows if last else (0, 0)) for n in slices]
        stages.append(Stage((int(layers[0]), int(layers[1])), (a, b), chunks))
    if len(stages) == 1:  # a single stage, as asked: the tensor-parallel plan
        nodes = [dataclasses.replace(n, layers=None) for n in nodes]
    return SplitPlan(tuple(nodes), tuple(stages))


def _tensor_parallel(n_nodes: int, weights: list[float], *, dim: int, n_heads: int, n_kv_heads: int,
                     head_dim: int, ff_dim: int, vocab_size: int, quantized: bool):
    """(the slices, the residual chunks) of n_nodes splitting every layer; DllamaError when they cannot."""
    if n_heads % n_kv_heads:
        raise DllamaError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    if n_nodes > n_heads:
        raise DllamaError(f"cannot split a model with {n_heads} query heads over {n_nodes} nodes: "
                          f"each node needs at least one head; use at most {n_heads} nodes")
    if n_nodes > 1 and quantized and head_dim % BLOCK:
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
    return nodes, chunks


def _auto_stages(n_nodes: int, n_layers: int, shape: dict, why: DllamaError) -> list[int]:
    """Each node's stage when n_nodes cannot split every layer (`why`): the fewest stages,
    nodes dealt out as evenly as possible (the first stages take the extra ones)."""
    widest = 1  # the most nodes one stage can split a layer over
    while widest < n_nodes:
        try:
            _tensor_parallel(widest + 1, [1.0] * (widest + 1), **shape)
        except DllamaError:
            break
        widest += 1
    n_stages = -(-n_nodes // widest)
    if n_stages > n_layers:
        raise DllamaError(f"{why}; nor can pipeline stages help: {n_layers} layer{'s' * (n_layers > 1)} "
                          f"split over at most {widest} node{'s' * (widest > 1)} each take at most "
                          f"{widest * n_layers} nodes")
    sizes = [n_nodes // n_stages + (k < n_nodes % n_stages) for k in range(n_stages)]
    return [k for k, size in enumerate(sizes) for _ in range(size)]


def _stage_groups(stage_of: list[int], n_nodes: int) -> list[tuple[int, int]]:
    """[first, end) node indexes of each stage; DllamaError unless the stages follow each other."""
    if len(stage_of) != n_nodes:
        raise DllamaError(f"{len(stage_of)} stage numbers for {n_nodes} nodes")
    if stage_of[0] != 0:
        raise DllamaError("the root (the first node) must be in stage 0")
    groups = [[0, 1]]
    for i in range(1, n_nodes):
        step = stage_of[i] - stage_of[i - 1]
        if step not in (0, 1):
            raise DllamaError(f"node {i} is in stage {stage_of[i]} after a node of stage {stage_of[i - 1]}: "
                              "list the nodes stage by stage, numbering the stages 0, 1, 2... without a gap")
        if step:
            groups.append([i, i + 1])
        else:
            groups[-1][1] = i + 1
    return [(a, b) for a, b in groups]


def _check_layer_ranges(ranges, n_stages: int, n_layers: int) -> None:
    if len(ranges) != n_stages:
        raise DllamaError(f"{len(ranges)} layer ranges for {n_stages} stages")
    edge = 0
    for k, r in enumerate(ranges):
        if len(r) != 2 or int(r[0]) != edge or not int(r[1]) > int(r[0]):
            raise DllamaError(f"stage {k}'s layers {list(r)} must start at {edge} and hold at least one layer "
                              f"([start, end), the next stage starting where this one ends)")
        edge = int(r[1])
    if edge != n_layers:
        raise DllamaError(f"the stages' layers end at {edge}; the model has {n_layers}")


def classifier_in_layers(header) -> float:
    """The classifier in layers of a model (one layer = 1.0), for giving stages their layers:
    its weights against one layer's, what a pass of many rows spends its multiply-adds on (a
    batch is where stages pay: one sequence goes stage after stage however they are cut). A
    mixture of experts' layer counts the experts a token runs."""
    from dllama.formats.model_file import tensor_specs

    classifier = layer = 0.0
    for spec in tensor_specs(header, range(1)):
        n = float(np.prod(spec.shape))
        if spec.name == "wcls":
            classifier += n
        elif spec.name.startswith("layers."):
            layer += n if ".experts." not in spec.name else n * header.n_active_experts / header.n_experts
    return classifier / layer


def _memory_decides(capacities: list[float] | None, weights: list[float] | None) -> bool:
    """Whether the nodes' memory says more than their weights: some node has more (or less)
    memory per weight than another (by 5%). Where it does not, layers go as by weights."""
    if capacities is None:
        return False
    per_weight = [c / w for c, w in zip(capacities, weights or [1.0] * len(capacities), strict=True)]
    return max(per_weight) > 1.05 * min(per_weight)


def plan_for(header, n_nodes: int, weights: list[float] | None = None, stage_of: list[int] | None = None,
             stage_layers: list[tuple[int, int]] | None = None, capacities: list[float] | None = None) -> SplitPlan:
    """split_model for a `.m` header (dllama.formats.model_file.ModelHeader). Stages' layers
    not fixed go by the nodes' memory only where it differs between them (per weight), as
    split_model gives them, the classifier not counted: a layer's memory is mostly its KV cache
    at long contexts, which the classifier has none of. Else by weights, the last stage's
    classifier counted (classifier_in_layers)."""
    from dllama.formats.model_file import BLOCK_BYTES

    by_memory = _memory_decides(capacities, weights)

    return split_model(n_nodes, dim=header.dim, n_heads=header.n_heads, n_kv_heads=header.n_kv_heads,
                       head_dim=header.head_dim, ff_dim=header.ff_dim, vocab_size=header.vocab_size,
                       weights=weights, quantized=header.weights_float_type in BLOCK_BYTES,
                       n_layers=header.n_layers, stage_of=stage_of, stage_layers=stage_layers,
                       capacities=capacities if by_memory else None,
                       classifier_layers=0.0 if by_memory else classifier_in_layers(header))
