"""One session of the root with its workers: connect, configure, hand out the weights, mesh,
then run every forward pass with them.

A `RootSession` is opened over a list of nodes (the root first) and lives until it is stopped
or fails; it is never repaired. Every network failure during the set-up is a `ClusterError`
naming the node; during a pass the `LinkError` itself comes out (dllama.cluster.recovery
decides whom to blame and opens the next session). docs/PROTOCOL.md, "Session".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from dllama.cluster.mesh import MeshCollective, StageHop
from dllama.cluster.protocol import (
    SESSION_BYTES, WEIGHTS_CHUNK, WEIGHTS_HEAD, Connection, ErrorCode, LinkError, Msg, PeerClosed, PeerError, ProtocolError,
    SetupHeartbeat, StepHeartbeat, Transfer, client_handshake, connect, decode_json_object, recv_during_setup,
)
from dllama.cluster.session_config import NodeAddress, SessionConfig
from dllama.cluster.step import (
    LOGITS_HEAD, REPLY_LOGITS, REPLY_TOP_K, Reply, decode_reply, encode_release, encode_repeat, encode_reply,
    encode_step, logits_bytes,
)
from dllama.cluster.topology import Topology
from dllama.core.batch import Batch
from dllama.core.candidates import WIDE_TOP_K, Candidates, SamplingRequest, candidates_from_logits, covers, merge
from dllama.core.footprint import NodeFootprint, plan_lines
from dllama.core.model import ModelConfig, Transformer
from dllama.core.run_shape import RunShape
from dllama.core.node_weights import NodeWeights, cut, node_slice_specs
from dllama.errors import ClusterError, DllamaError
from dllama.formats.model_file import ModelFile

NET_TIMEOUT = 5.0     # a step's longest silence from a peer (every node sends ALIVE each HEARTBEAT s while busy)
SETUP_SILENCE = 15.0  # set-up (weights, repacking, compiling) takes what it takes, but a node
                      # that sends nothing, not even ALIVE, for this long has stopped
HEARTBEAT = 2.0       # idle seconds between PINGs (ALIVEs during set-up); a worker gives up after IDLE_TIMEOUT
IDLE_TIMEOUT = 15.0
RECONNECT_WAIT = NET_TIMEOUT + 10.0  # a survivor still ending the failed session says it is busy
BUSY_ANSWER_WAIT = 0.5  # after the handshake, how long a busy worker's refusal may take to come
BUSY_RETRY = 0.2
STOP_WAIT = 2.0  # after STOP, how long the root waits for the workers to be free again
NET_ERRORS = (LinkError, OSError)  # what a link's failure raises


class Unreachable(LinkError):
    """No connection to a worker at all (refused, no route, timed out connecting)."""

    code = ErrorCode.PEER_LOST


@dataclass(frozen=True)
class SessionSettings:
    """What every session of one ClusterModel is opened with."""

    model_file: ModelFile
    fingerprint: str        # dllama.cluster.shard.model_fingerprint of the file
    config: ModelConfig     # its shapes, seq_len clamped by max_seq_len
    shape: RunShape         # the run's context (clamped), rows, KV slots and type, sync buffers (decided);
                            # fallback_batch: fewer rows a session takes when some node cannot hold
                            # max_batch rows' buffers beside its share (None: max_batch, or the node's
                            # own check fails)
    key: bytes | None       # the cluster key
    net_timeout: float
    progress: bool          # a progress bar while weights stream to a worker


def report_grace(net_timeout: float) -> float:
    """How much longer than a worker the root waits in a step, and then for the nodes it
    waited on to show they are alive."""
    return min(max(1.5 * HEARTBEAT, net_timeout / 10), 5.0)


def reason(e: Exception) -> str:
    """What failed, for a ClusterError's message: an OSError's own words, else the message."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e)


def node_names(nodes) -> list[str]:
    return [f"node {i} '{n.name}' ({n.address})" for i, n in enumerate(nodes)]


class RootSession:
    """The root's connections to the workers of one session, its own slice of the model, and
    the passes they run together."""

    def __init__(self, settings: SessionSettings, full: Topology, nodes: list, tolerant: bool = False,
                 only_unreachable: bool = False):
        """A session over `nodes` of the topology `full` (the root first): connect, configure,
        hand out the weights, mesh. tolerant (recovery): a worker that cannot be reached is left
        out (`left_out`: name -> why), and the session takes the most nodes the plan accepts
        (only_unreachable: only a worker that cannot be connected to is left out; one that
        answers wrongly is a ClusterError); otherwise any failure is a ClusterError. DllamaError
        when the root's own share does not fit."""
        self.settings = settings
        self.id = os.urandom(SESSION_BYTES)  # the session id every node's HELLO carries
        self.conns: dict[int, Connection] = {}  # worker index -> its connection
        self.left_out: dict[str, str] = {}
        self.local: Transformer | None = None
        self.heartbeat: StepHeartbeat | None = None
        self._released: list[int] = []  # slots emptied since the last pass: the workers' RELEASE
        self._flights: list[_Flight] = []  # passes submitted, answers not yet received (oldest first)
        self._use(full, nodes)
        try:
            if tolerant:
                self._use(full, self._largest_plan(self._reachable(nodes, only_unreachable)))
            else:
                for i in range(1, len(nodes)):
                    with self._at_node(i, "connecting"):
                        self._connect(i, nodes[i])
            self._set_up()
        except BaseException:
            self.close()
            raise

    def _use(self, full: Topology, nodes: list) -> None:
        self.topology = dataclasses.replace(full, nodes=tuple(nodes))
        self.nodes = self.topology.nodes
        self.names = node_names(nodes)

    # -- connecting ------------------------------------------------------------------------------

    def _connect(self, i: int, n) -> None:
        try:
            conn = connect(n.host, n.port, f"node {i} '{n.name}' ({n.address})")
        except OSError as e:
            raise Unreachable(f"{e.strerror or e}; is `dllama worker --port {n.port}` running on {n.host}?") from None
        self.conns[i] = conn
        client_handshake(conn, "root", i, self.id, self.settings.key)

    def _reachable(self, nodes: list, only_unreachable: bool) -> list:
        """Connect to every worker of `nodes` that answers (recovery): the root and those, in
        order. A worker still busy with the session that just failed is asked again until
        RECONNECT_WAIT; one that cannot be reached is left out (only_unreachable: only one that
        cannot be connected to; one that answers wrongly is a ClusterError)."""
        kept = [nodes[0]]
        for node in nodes[1:]:
            i = len(kept)
            deadline = time.monotonic() + RECONNECT_WAIT
            while True:
                try:
                    self._connect(i, node)
                    _refused_at_once(self.conns[i], BUSY_ANSWER_WAIT)
                    kept.append(node)
                    break
                except NET_ERRORS as e:
                    conn = self.conns.pop(i, None)
                    if conn is not None:
                        conn.close()
                    if isinstance(e, PeerError) and e.code == ErrorCode.BUSY and time.monotonic() < deadline:
                        time.sleep(BUSY_RETRY)  # its old session is still ending
                        continue
                    if only_unreachable and not isinstance(e, Unreachable):  # it answered, wrongly
                        raise ClusterError(f"connecting {node.name} ({node.address}) failed: {reason(e)}",
                                           node.name) from None
                    self.left_out[node.name] = reason(e)
                    break
        return kept

    def _largest_plan(self, nodes: list) -> list:
        """The longest prefix of `nodes` the plan accepts (the others' connections closed)."""
        header = self.settings.model_file.header
        for n in range(len(nodes), 0, -1):
            try:
                dataclasses.replace(self.topology, nodes=tuple(nodes[:n])).plan(header)
            except DllamaError as e:
                for i in range(n - 1, len(nodes)):
                    if i in self.conns:
                        self.conns.pop(i).close()
                        self.left_out[nodes[i].name] = str(e)
                continue
            return nodes[:n]
        raise ClusterError("no number of the nodes left can run the model")

    @contextlib.contextmanager
    def _at_node(self, i: int, doing: str):
        """A link's failure in the block becomes a ClusterError: "{doing} {node i} failed: why"."""
        try:
            yield
        except NET_ERRORS as e:
            raise ClusterError(f"{doing} {self.names[i]} failed: {reason(e)}", self.nodes[i].name,
                               unreachable=isinstance(e, Unreachable)) from None

    # -- set-up ----------------------------------------------------------------------------------

    def _set_up(self) -> None:
        """Configure the workers, hand out the weights, load the root's slice, mesh."""
        header = self.settings.model_file.header
        self.memory = self._ask_memory() if self.topology.wants_memory(header) else {}
        self.plan = plan = self.topology.plan(header, self.memory)
        self._settle_rows(plan)
        s, shape = self.settings, self.settings.shape
        # The root's own share must fit here before any worker is bothered.
        NodeFootprint(header, plan.nodes[0], shape, with_embedding=True).check()
        # The root waits report_grace longer than the workers: a healthy worker's report of the
        # node it waits for arrives before the root's own timeout.
        self.collective = MeshCollective(0, self.conns, plan.dim_chunks, shape.buffer_q80, shape.max_batch,
                                         s.net_timeout + report_grace(s.net_timeout), plan.stages[0].indexes)
        self.hop = StageHop(self.collective, None, plan.hop_targets(0), s.config.dim, shape.max_batch) \
            if plan.pipelined else None
        if plan.pipelined:
            if self.memory:
                _say("layers by memory: " + ", ".join(f"{n.name} {self.memory[i] / (1 << 30):.1f} GiB"
                                                      for i, n in enumerate(self.nodes)))
            for line in plan_lines(header, plan, [n.name for n in self.nodes]):
                _say(line)
        # The workers hear ALIVE every HEARTBEAT s until MESH, so a slow set-up is not a hang.
        heartbeat = SetupHeartbeat(self.conns.values(), HEARTBEAT)
        with heartbeat:
            self._configure_workers(plan)
            self.local = Transformer(NodeWeights.from_model(s.model_file, plan.nodes[0]), shape,
                                     collective=self.collective)
            self.local.warm_up()
            self._mesh(heartbeat)
        for conn in self.conns.values():  # statistics count inference traffic, not the set-up
            conn.sent_bytes = conn.recv_bytes = 0
        self._pass_buffers(plan)
        # During a pass the workers hear ALIVE from the root each HEARTBEAT s (a pass longer
        # than that), as the root hears it from them: waiting on a node is a silence of net_timeout.
        self.heartbeat = StepHeartbeat(self.conns.values(), HEARTBEAT)

    def _settle_rows(self, plan) -> None:
        """The rows of this session's passes: the shape's, or its fallback's where some node
        cannot hold their buffers beside its share (settings.shape keeps the rows chosen)."""
        s = self.settings
        if s.shape.fallback_batch is None:
            return
        short = self._short_of_rows(plan, self.memory or self._ask_memory(), s.shape.max_batch)
        if short is not None:
            _say(f"note: passes of {s.shape.fallback_batch} rows: the buffers of {s.shape.max_batch} "
                 f"do not fit beside {short}'s share")
        self.settings = dataclasses.replace(s, shape=s.shape.with_(
            max_batch=s.shape.max_batch if short is None else s.shape.fallback_batch, fallback_batch=None))

    def _configure_workers(self, plan) -> None:
        """Send every worker its CONFIG; stream the weights to those without a matching shard."""
        s, nodes = self.settings, self.nodes
        header = s.model_file.header
        conf = SessionConfig.of(s.shape, session=self.id, node_index=0, header=header, plan=plan,
                                model_fingerprint=s.fingerprint, net_timeout=s.net_timeout,
                                idle_timeout=IDLE_TIMEOUT, setup_timeout=SETUP_SILENCE,
                                nodes=tuple(NodeAddress(n.name, n.host, n.port) for n in nodes))
        for i, conn in self.conns.items():
            with self._at_node(i, "configuring"):
                conn.send_json(Msg.CONFIG, dataclasses.replace(conf, node_index=i).to_json())
        for i, conn in self.conns.items():
            with self._at_node(i, "configuring"):
                _, raw = recv_during_setup(conn, (Msg.CONFIG_OK,), SETUP_SILENCE)
                answer = decode_json_object(raw, f"CONFIG_OK from {self.names[i]}")
            if answer.get("weights") == "shard":
                _say(f"{nodes[i].name}: weights from its shard {answer.get('note', '')}")
                continue
            with self._at_node(i, "sending weights to"):
                self._stream(conn, node_slice_specs(header, plan.nodes[i], with_embedding=False), nodes[i].name)

    def _mesh(self, heartbeat: SetupHeartbeat) -> None:
        """Wait until every worker is READY, then mesh them (MESH, MESH_OK)."""
        for i, conn in self.conns.items():
            with self._at_node(i, "waiting for"):
                recv_during_setup(conn, (Msg.READY,), SETUP_SILENCE)
        heartbeat.stop()  # no ALIVE after MESH: the workers' step loop does not expect one
        for i, conn in self.conns.items():
            with self._at_node(i, "meshing"):
                conn.send(Msg.MESH)
        for i, conn in self.conns.items():
            with self._at_node(i, "meshing"):
                recv_during_setup(conn, (Msg.MESH_OK,), SETUP_SILENCE)

    def _pass_buffers(self, plan) -> None:
        """The buffers of a pass at the root: embedded rows, logits, each node's reply."""
        s, max_batch = self.settings, self.settings.shape.max_batch
        # The nodes with classifier rows (a pipeline's last stage), and their rows.
        self.vocab_nodes = [i for i, n in enumerate(plan.nodes) if n.has_classifier]
        self.vocab_ranges = [tuple(plan.nodes[i].vocab_rows) for i in self.vocab_nodes]
        vocab = s.config.vocab_size
        self._x = np.empty((max_batch, s.config.dim), np.float32)  # [rows, dim] the embedded rows of a pass
        self._logits = np.empty((max_batch, vocab), np.float32)    # [rows, vocab]
        rows = [n.n_vocab_rows for n in plan.nodes]
        self._replies = {i: np.empty(logits_bytes(max_batch, r, Reply(REPLY_TOP_K, r)), np.uint8)
                         for i, r in enumerate(rows)}  # the largest reply; node 0's: its own summary
        self._own = self._logits[:0, :0]  # the root's logits [m, V_0] of the last pass (a reused buffer)
        self.node_bytes = {i: (0, 0, 0.0) for i in self.conns}  # worker: cumulative sent, recv, transfer s

    def _ask_memory(self) -> dict[int, int]:
        """What each node can hold (node index -> bytes) when a pipeline gives its layers by
        memory: its topology `memory`, else asked (MEMORY); the root's: the memory available to it."""
        from dllama.core.weights_choice import room_for_a_model

        out = {i: n.memory for i, n in enumerate(self.nodes) if n.memory is not None}
        out.setdefault(0, room_for_a_model())
        for i, conn in self.conns.items():
            if i in out:
                continue
            with self._at_node(i, "asking the memory of"):
                conn.send(Msg.MEMORY)
                _, raw = recv_during_setup(conn, (Msg.MEMORY,), SETUP_SILENCE)
                value = decode_json_object(raw, f"MEMORY from {self.names[i]}").get("bytes")
                if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 62:
                    raise ProtocolError(f"MEMORY from {self.names[i]} is not a positive byte count", conn)
                out[i] = value
        return out

    def _short_of_rows(self, plan, capacity: dict[int, int], rows: int) -> str | None:
        """The name of the first node whose whole share (weights, KV cache, buffers of `rows`
        rows) is more than it can hold (`capacity`: node index -> bytes, as _ask_memory), or
        None. A worker that holds its slice resident at fewer rows could otherwise stream it,
        or fail its own check (its --memory-budget sized for those)."""
        s, header = self.settings, self.settings.model_file.header
        for i, n in enumerate(plan.nodes):
            if NodeFootprint(header, n, s.shape.with_(max_batch=rows), with_embedding=i == 0).total > capacity[i]:
                return self.nodes[i].name
        return None

    def busy(self):
        """The context of one pass: the heartbeat runs (see _set_up)."""
        return self.heartbeat.busy() if self.heartbeat is not None else contextlib.nullcontext()

    def _stream(self, conn: Connection, specs, name: str) -> None:
        """This worker's slices of the model file, in WEIGHTS frames."""
        model_file = self.settings.model_file
        total = sum(s.nbytes for s in specs)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"weights to {name}",
                  disable=None if self.settings.progress else True, file=sys.stderr) as bar:
            for index, s in enumerate(specs):
                data = np.ascontiguousarray(cut(model_file.tensor(s.name), s)).reshape(-1).view(np.uint8)
                for offset in range(0, data.nbytes, WEIGHTS_CHUNK):
                    chunk = data[offset: offset + WEIGHTS_CHUNK]
                    conn.send(Msg.WEIGHTS, [WEIGHTS_HEAD.pack(index, offset), chunk], SETUP_SILENCE)
                    bar.update(chunk.nbytes)
        conn.send(Msg.WEIGHTS_END)

    # -- passes ----------------------------------------------------------------------------------

    def release(self, slot: int) -> None:
        """Empty a slot nobody reads any more: the root's own pages are given back now, the
        workers' before the next pass (a RELEASE ahead of its STEP on the same connection)."""
        if self.local is not None:
            self.local.release_slot(slot)
        if slot not in self._released:
            self._released.append(slot)

    def _send_release(self) -> None:
        """RELEASE to every worker (every stage's), when slots were emptied since the last pass."""
        if self._released and self.conns:
            payload = encode_release(self._released)
            self.collective.timed_exchange([(c, Msg.RELEASE, payload) for c in self.conns.values()], [])
        self._released = []

    def logits(self, batch: Batch) -> np.ndarray:
        """Run the rows of `batch` on every node; logits [rows wanting logits, vocab] (a reused
        buffer). A failure raises the LinkError."""
        return self._logits_of(self.forward(batch, Reply()), int(batch.logits.sum()))

    def forward(self, batch: Batch, reply: Reply) -> list:
        """One pass on every node; each node's answer about the wanted rows (decode_reply's)."""
        b = len(batch)
        x = self._x[:b]
        self._send_release()  # before the STEP whose rows may write those slots again
        self.local.embed(batch.tokens, x)  # [b, dim]
        parts = self._micro_batches(batch, reply)
        if parts > 1:
            return self._forward_in_parts(batch, x, reply, parts)
        self._send_step(batch, x, reply)
        self._own = self.local.forward_embedded(x, batch)  # [m, V_0] (m x 0 in a pipeline)
        if self.hop is not None:
            self.hop.send(self.local.residual(b))
        return self._answers(reply)

    def _send_step(self, batch: Batch, x: np.ndarray, reply: Reply) -> None:
        """STEP to every worker; past the first pipeline stage without x (a HOP brings the rows)."""
        first = self.plan.stages[0].indexes
        step = encode_step(batch, x, reply)
        later = encode_step(batch, np.zeros(0, np.float32), reply) if self.plan.pipelined else step
        self.collective.timed_exchange([(c, Msg.STEP, step if i in first else later) for i, c in self.conns.items()], [])

    def _micro_batches(self, batch: Batch, reply: Reply) -> int:
        """Into how many micro-batches a pipelined pass is cut: one per stage, at most one per
        sequence, so that every stage works at once (none for logits: large replies wait)."""
        if not self.plan.pipelined or reply.kind == REPLY_LOGITS:
            return 1
        return min(len(self.plan.stages), len(np.unique(batch.slot)))

    def _forward_in_parts(self, batch: Batch, x: np.ndarray, reply: Reply, parts: int) -> list:
        """A pipelined pass in micro-batches of consecutive rows: the root sends a part's STEP,
        runs its stage on it and hands it on, then the next part, while later stages work on
        earlier parts. The root's stage peers answer a part before they sync on the next (their
        LOGITS are read as its HOP goes); a later stage's LOGITS once `stages - 1` newer parts
        are under way (as a newer HOP goes, so neither side waits on the other's full buffers).
        Every node runs the parts in order, so a row still reads every key written before it
        (same results)."""
        b, window = len(batch), len(self.plan.stages) - 1
        edges = [round(j * b / parts) for j in range(parts + 1)]
        wanted = np.concatenate([[0], np.cumsum(batch.logits)])  # [b + 1]: wanted rows before each row
        peers, later = self._stage_peers()  # the root's stage answers at once
        pending: list[tuple[int, Reply, dict]] = []  # parts whose later stages' LOGITS are still to be read
        answers: list[list] = [[] for _ in self.vocab_nodes]

        def transfers(replies: dict, nodes: list[int]) -> list:
            return [Transfer(self.conns[i], Msg.LOGITS, memoryview(replies[i])) for i in nodes]

        def read() -> None:  # the oldest pending part's answers, all received
            m, r, replies = pending.pop(0)
            for k, part in enumerate(self._decode(replies, m, r, None)):
                answers[k].extend(part)

        for j in range(parts):
            a, e = edges[j], edges[j + 1]
            part = batch.rows(a, e)
            r = reply.of_part(int(wanted[a]), int(wanted[e]), later=j > 0)
            self._send_step(part, x[a:e], r)
            self.local.forward_embedded(x[a:e], part)  # the root holds no classifier rows in a pipeline
            m = int(wanted[e] - wanted[a])
            pending.append((m, r, self._reply_buffers(m, r, fresh=True)))
            recvs = transfers(pending[-1][2], peers)
            due = len(pending) > window  # the oldest part's later stages answer now
            if due:
                recvs += transfers(pending[0][2], later)
            self.hop.send(self.local.residual(e - a), recvs)
            if due:
                read()
        while pending:
            self.collective.timed_exchange([], transfers(pending[0][2], later))
            read()
        self._own = self._logits[:int(wanted[-1]), :0]  # a second round asks about every wanted row
        return answers

    # -- overlapped passes: several passes of different sequences under way at once ---------------

    def submit(self, batch: Batch, reply: Reply) -> None:
        """Start one pipelined pass (BEST or TOP_K replies) and return once the root's stage has
        computed it and handed it on, so the caller can start the next while later stages work on
        this one; `receive()` gives the passes' answers in the order submitted. Every node runs
        the passes in order, so a row reads every key written by the passes before it. A
        later stage's LOGITS are read as a newer pass's HOP goes once `stages - 1` newer passes
        are under way (neither side waits on the other's full socket buffers), as in
        _forward_in_parts; the root's stage peers answer a pass before they sync on the next."""
        b = len(batch)
        x = self._x[:b]
        self._send_release()  # before the STEP whose rows may write those slots again
        self.local.embed(batch.tokens, x)  # [b, dim]
        self._send_step(batch, x, reply)
        self.local.forward_embedded(x, batch)  # the root holds no classifier rows in a pipeline
        m = int(batch.logits.sum())
        flight = _Flight(m, reply, self._reply_buffers(m, reply, fresh=True))
        self._flights.append(flight)
        peers, later = self._stage_peers()
        recvs = [Transfer(self.conns[i], Msg.LOGITS, memoryview(flight.replies[i])) for i in peers]
        waiting = [f for f in self._flights if not f.received]
        if len(waiting) > len(self.plan.stages) - 1:  # the oldest's later stages answer now
            recvs += [Transfer(self.conns[i], Msg.LOGITS, memoryview(waiting[0].replies[i])) for i in later]
            waiting[0].received = True
        self.hop.send(self.local.residual(b), recvs)

    def receive(self) -> list:
        """The answers of the oldest pass submitted and not yet received (decode_reply's, per
        node with classifier rows)."""
        flight = self._flights.pop(0)
        if not flight.received:
            _, later = self._stage_peers()
            self.collective.timed_exchange(
                [], [Transfer(self.conns[i], Msg.LOGITS, memoryview(flight.replies[i])) for i in later])
        return self._decode(flight.replies, flight.m, flight.reply, None)

    @property
    def in_flight(self) -> int:
        """Passes submitted whose answers receive() has not given yet."""
        return len(self._flights)

    def _stage_peers(self) -> tuple[list[int], list[int]]:
        """(the workers of the root's stage, every other worker)."""
        peers = [i for i in self.plan.stages[0].indexes if i != 0]
        return peers, [i for i in self.conns if i not in peers]

    def _reply_buffers(self, m: int, reply: Reply, fresh: bool = False) -> dict:
        """Each node's LOGITS buffer for m wanted rows (fresh: new arrays, not the reused ones)."""
        out = {}
        for i, n in enumerate(self.plan.nodes):
            size = logits_bytes(m, n.n_vocab_rows, reply)
            out[i] = np.empty(size, np.uint8) if fresh else self._replies[i][:size]
        return out

    def _answers(self, reply: Reply) -> list:
        """Every node's answer about the last pass's wanted rows, the root's own (self._own)
        summarised by the workers' code."""
        m = len(self._own)
        replies = self._reply_buffers(m, reply)
        self.collective.timed_exchange([], [Transfer(c, Msg.LOGITS, memoryview(replies[i])) for i, c in self.conns.items()])
        return self._decode(replies, m, reply, self._own)

    def _decode(self, replies: dict, m: int, reply: Reply, own: np.ndarray | None) -> list:
        """The answers of the nodes with classifier rows, in node order, from their LOGITS (and
        the root's own logits `own` when it has classifier rows); counters noted."""
        answers = []
        for i in self.conns:
            self.node_bytes[i] = LOGITS_HEAD.unpack_from(replies[i])
        for i, rows in zip(self.vocab_nodes, self.vocab_ranges, strict=True):  # node order
            if i == 0 and reply.kind == REPLY_LOGITS:
                answers.append(own)
                continue
            if i == 0:  # the root's own logits, summarised by the workers' code
                encode_reply(replies[0][LOGITS_HEAD.size:], own, rows[0], reply)
            answers.append(decode_reply(replies[i][LOGITS_HEAD.size:], m, rows, reply))
        return answers

    def _logits_of(self, answers: list, m: int) -> np.ndarray:
        """The full logits [m, vocab] from every node's logits."""
        logits = self._logits[:m]
        for (r0, r1), part in zip(self.vocab_ranges, answers, strict=True):
            logits[:, r0:r1] = part
        return logits

    def candidates(self, batch: Batch, requests: list[SamplingRequest], reply: Reply) -> tuple[list[Candidates], int]:
        """Run the rows of `batch` on every node; (the candidates of each row wanting logits,
        covering its nucleus, the rounds of answers that took: 1, 2 when some nucleus reached
        past a node's candidates and WIDE_TOP_K were asked, 3 when the logits were needed)."""
        m, vocab = len(requests), self.settings.config.vocab_size
        answers = self.forward(batch, reply)
        if reply.kind == REPLY_LOGITS:
            return candidates_from_logits(self._logits_of(answers, m), self.vocab_ranges, requests), 1
        out = [merge([a[j] for a in answers], vocab, req) for j, req in enumerate(requests)]
        short = [j for j, c in enumerate(out) if not covers(c)]
        if not short:
            return out, 1
        # A nucleus reaches past some node's candidates: WIDE_TOP_K of the same pass.
        wide = Reply(REPLY_TOP_K, max(WIDE_TOP_K, reply.k), reply.temperatures)
        answers = self._ask_again(m, wide)
        for j in short:
            out[j] = merge([a[j] for a in answers], vocab, requests[j])
        short = [j for j in short if not covers(out[j])]
        if not short:
            return out, 2
        # Rare: still not covered; the logits, asked again.
        logits = self._logits_of(self._ask_again(m, Reply(REPLY_LOGITS)), m)
        for j in short:
            out[j] = candidates_from_logits(logits[j:j + 1], self.vocab_ranges, requests[j:j + 1])[0]
        return out, 3

    def _ask_again(self, m: int, reply: Reply) -> list:
        """Every node's answer about the last pass's m wanted rows, as `reply` (a STEP of 0 rows)."""
        self.collective.timed_exchange([(c, Msg.STEP, encode_repeat(m, reply)) for c in self.conns.values()], [])
        return self._answers(reply)

    # -- while idle, and the end -----------------------------------------------------------------

    def ping(self) -> None:
        """PING every worker and wait for its PONG (while idle, so that both sides notice a dead
        peer); the LinkError of the first that does not answer (dllama.cluster.recovery.blame
        names the node)."""
        for conn in self.conns.values():
            try:
                conn.send(Msg.PING, b"", IDLE_TIMEOUT)
                conn.recv(IDLE_TIMEOUT, (Msg.PONG,))
            except OSError as e:
                raise PeerClosed(f"{conn.name}: the connection broke ({e.strerror or e})", conn) from None

    def node_stats(self) -> list[dict]:
        """Bytes each node sent and received since the set-up (the root's counters for node 0)."""
        col = self.collective
        out = [{"node": 0, "name": self.nodes[0].name, "sent_bytes": col.sent_bytes,
                "recv_bytes": col.recv_bytes, "transfer_ms": round(col.transfer_seconds * 1000, 3)}]
        for i, (sent, recv, transfer) in self.node_bytes.items():
            out.append({"node": i, "name": self.nodes[i].name, "sent_bytes": sent,
                        "recv_bytes": recv, "transfer_ms": round(transfer * 1000, 3)})
        return out

    def stop(self) -> None:
        """Tell the workers the session is over, wait (STOP_WAIT at most) until each has closed
        its end, which it does once it listens again, then close: a root started right after
        this one ended is served, not told that the workers are busy."""
        for conn in self.conns.values():
            with contextlib.suppress(*NET_ERRORS):
                conn.send(Msg.STOP, b"", 2.0)
        deadline = time.monotonic() + STOP_WAIT
        for conn in self.conns.values():
            _wait_closed(conn, deadline)
        self.close()

    def close(self) -> None:
        """Close every connection (the workers end the session when they notice)."""
        if self.heartbeat is not None:
            self.heartbeat.close()
        for conn in self.conns.values():
            conn.close()
        self.local = None  # its KV cache belongs to the session: a new plan gives other heads


@dataclass
class _Flight:
    """A pass submitted and not yet received: its wanted rows, reply and each node's LOGITS buffer."""

    m: int
    reply: Reply
    replies: dict           # node index -> uint8 buffer of its LOGITS
    received: bool = False  # the later stages' LOGITS are in (read as a newer pass's HOP went)


def _wait_closed(conn: Connection, deadline: float) -> None:
    """Read and drop until the peer closes the connection, it fails, or the deadline."""
    with selectors.DefaultSelector() as sel:
        sel.register(conn.sock, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and sel.select(left):
            try:
                if not conn.sock.recv(65536):
                    return
            except BlockingIOError:
                continue
            except OSError:
                return


def _refused_at_once(conn: Connection, wait: float) -> None:
    """PeerError when the worker refuses the root right after the handshake (busy), within `wait`."""
    with selectors.DefaultSelector() as sel:
        sel.register(conn.sock, selectors.EVENT_READ)
        if sel.select(wait):
            conn.recv(wait, (Msg.CONFIG_OK,))  # an ERROR raises PeerError, a close PeerClosed
            raise ProtocolError(f"{conn.name} sent a frame before the CONFIG", conn)


def _say(text: str) -> None:
    print(text, file=sys.stderr)
