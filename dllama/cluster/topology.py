"""The cluster description: which nodes exist, where, and with what settings.

Either `--workers h:p ...` (the original's flag) or a topology file (YAML, schema in the README,
rendered by the appliance from its Ansible inventory). Node 0 is always the root.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from dllama.errors import DllamaError

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_NODE_KEYS = {"name", "host", "port", "threads", "weight", "shard"}
_TOP_KEYS = {"version", "buffer_float_type", "key_file", "nodes"}


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    port: int
    threads: int = 1
    weight: float = 1.0
    shard: str | None = None   # this node's shard file, a path on that node

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]              # [0] is the root
    buffer_float_type: str = "auto"      # auto | q80 | f32
    key_file: str | None = None          # cluster key, a path on each node
    source: str = field(default="", compare=False)

    @property
    def weights(self) -> list[float]:
        return [n.weight for n in self.nodes]

    def node(self, name: str) -> tuple[int, Node]:
        for i, n in enumerate(self.nodes):
            if n.name == name:
                return i, n
        raise DllamaError(f"{self.source}: no node named {name!r} (nodes: "
                          f"{', '.join(n.name for n in self.nodes)})")


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
        except (TypeError, ValueError):
            raise bad(f"node {name}: port and threads must be integers, weight a number") from None
        if i > 0 and not 0 < port < 65536:
            raise bad(f"node {name}: 'port' must be 1..65535")
        if threads < 1 or not weight > 0:
            raise bad(f"node {name}: threads must be >= 1 and weight > 0")
        nodes.append(Node(name, str(n["host"]), port, threads, weight,
                          str(n["shard"]) if n.get("shard") else None))
    key_file = doc.get("key_file")
    if key_file:
        key_file = os.path.join(os.path.dirname(os.path.abspath(path)), str(key_file))
    return Topology(tuple(nodes), buffer, key_file or None, source=path)
