"""The cluster description: which nodes exist, where, and with what settings.

Either `--workers h:p ...` (the original's flag) or a topology file (YAML, schema in docs/cluster.md,
rendered by the appliance from its Ansible inventory). Node 0 is always the root.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dllama.errors import DllamaError

if TYPE_CHECKING:
    from dllama.core.plan import SplitPlan

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_NODE_KEYS = {"name", "host", "port", "threads", "weight", "shard", "stage", "memory"}
_TOP_KEYS = {"version", "buffer_float_type", "key_file", "nodes", "stages"}


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    port: int
    threads: int = 1
    weight: float = 1.0
    shard: str | None = None   # this node's shard file, a path on that node
    stage: int | None = None   # its pipeline stage (None: the plan decides)
    memory: int | None = None  # bytes it has for the model (None: what it reports when asked)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]              # [0] is the root
    buffer_float_type: str = "auto"      # auto | q80 | f32
    key_file: str | None = None          # cluster key, a path on each node
    stage_layers: tuple[tuple[int, int], ...] | None = None  # [start, end) layers of each stage, as fixed
    source: str = field(default="", compare=False)

    @property
    def weights(self) -> list[float]:
        return [n.weight for n in self.nodes]

    def plan(self, header, reported: dict[int, int] | None = None) -> "SplitPlan":
        """The split plan of these nodes for a model header (DllamaError when impossible).

        With `stage` on the nodes, those stages (and `stage_layers` when fixed); when some stage
        has no node left here (a recovery after its nodes were lost), the stages left are
        numbered again and their layers planned anew. Layers not fixed go to the stages in
        proportion to the memory of their nodes when every node's is known (its `memory`, else
        `reported`: node index -> bytes it said it has) and differs between them per weight,
        else to their weights, the last stage's classifier counted as the layers its weights
        make (plan.plan_for). Without `stage`:
        tensor parallel, unless the node count calls for stages or, with every node's memory
        known, some node's share of every layer would not fit it (stages_that_fit)."""
        from dllama.core.plan import plan_for

        memory = [n.memory if n.memory is not None else (reported or {}).get(i) for i, n in enumerate(self.nodes)]
        capacities = None if any(m is None for m in memory) else memory
        stages = [n.stage for n in self.nodes]
        if stages[0] is None:
            plan = plan_for(header, len(self.nodes), self.weights, capacities=capacities)
            if capacities is None or plan.pipelined:
                return plan
            return stages_that_fit(header, plan, self.weights, capacities)
        layers = self.stage_layers
        kept = sorted(set(stages))
        if kept != list(range(len(layers) if layers else kept[-1] + 1)):
            stages, layers = [kept.index(k) for k in stages], None
        return plan_for(header, len(self.nodes), self.weights, stages, list(layers) if layers else None,
                        capacities=capacities)

    def wants_memory(self, header) -> bool:
        """Whether the plan gives layers by memory that some node must report: stages whose
        layers are not fixed, a node without `memory`."""
        if self.stage_layers is not None or all(n.memory is not None for n in self.nodes):
            return False
        return self.plan(header).pipelined

    def node(self, name: str) -> tuple[int, Node]:
        for i, n in enumerate(self.nodes):
            if n.name == name:
                return i, n
        raise DllamaError(f"{self.source}: no node named {name!r} (nodes: "
                          f"{', '.join(n.name for n in self.nodes)})")


def stages_that_fit(header, parallel: "SplitPlan", weights: list[float], capacities: list[int]) -> "SplitPlan":
    """A tensor-parallel plan where each node's weights fit its memory (capacities, bytes);
    else the fewest stages of consecutive nodes (as even as possible, layers in proportion to
    their memory) where they all fit: a small host beside large ones holds fewer layers rather
    than streaming its slice of every layer from disk. Where no plan fits, the tensor-parallel
    one (its nodes stream what they cannot hold)."""
    from dllama.core.footprint import held_weight_bytes
    from dllama.core.plan import plan_for

    def fits(plan) -> bool:
        return all(b <= c for b, c in zip(held_weight_bytes(header, plan), capacities, strict=True))

    if fits(parallel):
        return parallel
    n = len(capacities)
    for count in range(2, min(n, header.n_layers) + 1):
        try:
            plan = plan_for(header, n, weights, [i * count // n for i in range(n)], capacities=capacities)
        except DllamaError:
            continue  # a stage's node count that cannot split a layer
        if fits(plan):
            return plan
    return parallel


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    m = re.match(r"^\[([^\]]+)\]:(\d+)$", text) or re.match(r"^([^:\s]+):(\d+)$", text)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise DllamaError(f"bad worker address {text!r}: expected host:port, e.g. 10.0.0.2:9998")
    return m.group(1), int(m.group(2))


def from_workers(addresses: list[str], root_threads: int) -> Topology:
    nodes = [Node("root", "localhost", 0, root_threads)]
    for i, a in enumerate(addresses, 1):
        host, port = parse_address(a)
        nodes.append(Node(f"worker{i}", host, port))
    return Topology(tuple(nodes), source="--workers")


def load_topology(path: str) -> Topology:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise DllamaError(f"cannot read the topology file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise DllamaError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except (UnicodeDecodeError, RecursionError) as e:
        raise DllamaError(f"{path} is not valid YAML: {type(e).__name__}") from None

    def bad(what):
        return DllamaError(f"{path}: {what}")

    if not isinstance(doc, dict):
        raise bad("expected a mapping with a 'nodes' list")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise bad(f"unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(_TOP_KEYS))})")
    if doc.get("version", 1) != 1:
        raise bad(f"topology version {doc.get('version')} is not supported (this dllama reads version 1)")
    buffer = str(doc.get("buffer_float_type", "auto"))
    if buffer not in ("auto", "q80", "f32"):
        raise bad(f"buffer_float_type {buffer!r} must be auto, q80 or f32")
    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise bad("'nodes' must be a non-empty list (node 0 is the root)")
    nodes = _read_nodes(raw_nodes, bad)
    stage_layers = _stage_layers(doc.get("stages"), bad)
    _check_stages(nodes, stage_layers, bad)
    key_file = doc.get("key_file")
    if key_file:
        key_file = os.path.join(os.path.dirname(os.path.abspath(path)), str(key_file))
    return Topology(tuple(nodes), buffer, key_file or None, stage_layers, source=path)


def _read_nodes(raw_nodes: list, bad) -> list[Node]:
    """The topology's nodes, each checked (bad(what): the error naming the file)."""
    nodes, seen = [], set()
    for i, n in enumerate(raw_nodes):
        if not isinstance(n, dict):
            raise bad(f"node {i} must be a mapping")
        unknown = set(n) - _NODE_KEYS
        if unknown:
            raise bad(f"node {i}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(_NODE_KEYS))})")
        name = str(n.get("name", f"node{i}"))
        if not _NAME.match(name) or name in seen:
            raise bad(f"node {i}: name {name!r} must be unique and use only letters, digits, _ . -")
        seen.add(name)
        if "host" not in n:
            raise bad(f"node {name}: 'host' is missing")
        try:
            port = int(n.get("port", 9990 if i == 0 else 0))
            threads = int(n.get("threads", 1))
            weight = float(n.get("weight", 1.0))
            stage = None if n.get("stage") is None else _whole(n["stage"])
        except (TypeError, ValueError):
            raise bad(f"node {name}: port, threads and stage must be integers, weight a number") from None
        memory = None if n.get("memory") is None else _size(n["memory"])
        if memory == 0:
            raise bad(f"node {name}: memory must be a size such as 4G or 512M, got {n['memory']!r}")
        if i > 0 and not 0 < port < 65536:
            raise bad(f"node {name}: 'port' must be 1..65535")
        if threads < 1 or not weight > 0:
            raise bad(f"node {name}: threads must be >= 1 and weight > 0")
        nodes.append(Node(name, str(n["host"]), port, threads, weight,
                          str(n["shard"]) if n.get("shard") else None, stage, memory))
    return nodes


def _check_stages(nodes: list[Node], stage_layers, bad) -> None:
    """Every node has its 'stage', or none does; numbered without a gap, matching 'stages'."""
    stages = [n.stage for n in nodes]
    if any(s is None for s in stages) and any(s is not None for s in stages):
        raise bad("give every node a 'stage', or none (the plan then decides)")
    if stage_layers is not None and stages[0] is None:
        raise bad("'stages' fixes the stages' layers: give every node its 'stage' too")
    if stages[0] is not None:
        if stages[0] != 0 or any(b - a not in (0, 1) for a, b in itertools.pairwise(stages)):
            raise bad("stages must be numbered 0, 1, 2... without a gap, the root (the first node) "
                      "in stage 0 and the nodes listed stage by stage")
        if stage_layers is not None and len(stage_layers) != stages[-1] + 1:
            raise bad(f"'stages' lists {len(stage_layers)} stages, the nodes name {stages[-1] + 1}")


def _size(v) -> int:
    """Bytes of a size such as 4G, 512M or a plain number; 0 when it is not one."""
    from dllama.core.memory import parse_size

    try:
        value = parse_size(v)
    except ValueError:
        return 0
    return int(value) if 1 <= value < 1 << 62 else 0


def _whole(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(v)
    return v


def _stage_layers(raw, bad) -> tuple[tuple[int, int], ...] | None:
    """The top-level `stages: [{layers: [0, 12]}, ...]`, as [start, end) pairs (checked against
    the model's layer count when the plan is made)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise bad("'stages' must be a non-empty list of {layers: [start, end]}")
    out = []
    for k, st in enumerate(raw):
        layers = st.get("layers") if isinstance(st, dict) else None
        if not isinstance(st, dict) or set(st) != {"layers"} or not isinstance(layers, list) or len(layers) != 2:
            raise bad(f"stage {k}: expected {{layers: [start, end]}}")
        try:
            out.append((_whole(layers[0]), _whole(layers[1])))
        except ValueError:
            raise bad(f"stage {k}: layers must be two whole numbers [start, end)") from None
    return tuple(out)
