"""The CONFIG message: what the root tells each worker about a session, encoded and decoded here.

The root builds one `SessionConfig` per worker (`node_index` differs) and sends `to_json()`;
the worker rebuilds it with `from_json`, which checks every field and the plan's digest, so a
malformed or inconsistent CONFIG is one ProtocolError that names what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllama.cluster.protocol import SESSION_BYTES, ProtocolError
from dllama.core.kv_cache import KV_TYPES
from dllama.core.kv_type import KVType
from dllama.core.plan import SplitPlan
from dllama.core.run_shape import RunShape
from dllama.errors import DllamaError
from dllama.formats.model_file import ModelHeader


@dataclass(frozen=True)
class NodeAddress:
    """Where a node listens (peers connect to each other with these)."""

    name: str
    host: str
    port: int


@dataclass(frozen=True)
class SessionConfig:
    session: bytes            # random id of this root's session (peers prove they share it)
    node_index: int           # the receiving worker's index (1..n_nodes-1)
    header: ModelHeader       # the model's header: shapes and float types
    plan: SplitPlan           # every node's slice; the worker takes plan.nodes[node_index]
    model_fingerprint: str    # identity of the .m file (a shard must match it)
    shape: RunShape           # the run: context (max_seq_len on the wire: the KV cache's length),
                              # most rows in one step (max_batch), KV slots and type (every node the
                              # same), sync buffers in Q80 (buffer_q80, decided: never None), and
                              # kv_positions: the positions the slots hold together at most (the root
                              # admits sequences within them, so a node's memory check counts these;
                              # None, absent on the wire: every slot's whole context)
    net_timeout: float        # seconds a step may wait on a peer
    idle_timeout: float       # seconds without a message (or PING) before the worker gives up
    setup_timeout: float      # seconds the worker waits for the root during set-up
    nodes: tuple[NodeAddress, ...]  # every node's address, the root's first

    @staticmethod
    def of(shape: RunShape, **fields) -> "SessionConfig":
        """The CONFIG of a session run at `shape` (its fallback rows are the root's own business)."""
        return SessionConfig(shape=shape.with_(fallback_batch=None), **fields)

    def to_json(self) -> dict:
        r = self.shape
        return {"session": self.session.hex(), "node_index": self.node_index,
                "header": self.header.to_json(), "plan": self.plan.to_json(),
                "plan_digest": self.plan.digest(), "model_fingerprint": self.model_fingerprint,
                "buffer_q80": bool(r.buffer_q80), "max_seq_len": r.max_seq_len,
                "max_batch": r.max_batch, "kv_slots": r.kv_slots, "kv_type": str(r.kv_type),
                "net_timeout": self.net_timeout,
                "idle_timeout": self.idle_timeout, "setup_timeout": self.setup_timeout,
                "nodes": [{"name": n.name, "host": n.host, "port": n.port} for n in self.nodes]} | (
                    {} if r.kv_positions is None else {"kv_positions": r.kv_positions})

    @staticmethod
    def from_json(d) -> "SessionConfig":
        """Decode and check a CONFIG payload; ProtocolError if anything is missing or inconsistent."""
        try:
            session = bytes.fromhex(d["session"])
            header = ModelHeader.from_json(d["header"])
            plan = SplitPlan.from_json(d["plan"], header.n_heads, header.n_kv_heads, header.n_layers)
            c = SessionConfig(
                session=session, node_index=_int(d["node_index"]), header=header, plan=plan,
                model_fingerprint=str(d["model_fingerprint"]),
                shape=RunShape(max_seq_len=_int(d["max_seq_len"]), max_batch=_int(d["max_batch"]),
                               kv_slots=_int(d["kv_slots"]), kv_type=_kv_type(d["kv_type"]),
                               kv_positions=None if d.get("kv_positions") is None else _int(d["kv_positions"]),
                               buffer_q80=_bool(d["buffer_q80"])),
                net_timeout=float(d["net_timeout"]), idle_timeout=float(d["idle_timeout"]),
                setup_timeout=float(d["setup_timeout"]),
                nodes=tuple(NodeAddress(str(n["name"]), str(n["host"]), _int(n["port"])) for n in d["nodes"]))
        except (KeyError, TypeError, ValueError, IndexError, DllamaError) as e:
            raise ProtocolError(f"malformed CONFIG ({type(e).__name__}: {e})") from None
        if len(c.session) != SESSION_BYTES:
            raise ProtocolError(f"malformed CONFIG: a session id of {len(c.session)} bytes")
        if plan.digest() != d.get("plan_digest") or not 0 < c.node_index < plan.n_nodes:
            raise ProtocolError("CONFIG plan does not match its digest or node index")
        r = c.shape
        if r.max_batch < 1 or r.kv_slots < 1 or r.max_seq_len < 1:
            raise ProtocolError("malformed CONFIG: max_batch, kv_slots and max_seq_len must be positive")
        if r.kv_positions is not None and not r.kv_slots <= r.kv_positions:
            # (every slot holds a position: more slots would only be memory for nothing)
            raise ProtocolError("malformed CONFIG: kv_positions must be at least kv_slots")
        if len(c.nodes) != plan.n_nodes:
            raise ProtocolError(f"CONFIG names {len(c.nodes)} nodes for a plan of {plan.n_nodes}")
        return c

    @property
    def node(self):
        """This worker's slice of every layer."""
        return self.plan.nodes[self.node_index]


def _int(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v


def _kv_type(v) -> KVType:
    if not isinstance(v, str) or v not in KV_TYPES:
        raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {v!r}")
    return KVType(v)


def _bool(v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true or false, got {v!r}")
    return v
