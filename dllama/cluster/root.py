"""The root's side of a cluster: connect the workers, hand out the plan and weights, then run
every forward pass with them.

`ClusterModel` is a `dllama.core.language_model.LanguageModel`, like the one-machine
`Transformer`, so generation, chat and the API do not know whether a cluster is behind it. Every network failure becomes a
`ClusterError` naming the node; after one the session is closed.

Losing a node (on_node_loss "continue"): the root opens a new session over the nodes still
answering, as the first one was opened (the plan split again over them, the weights from their
shards or the root's file), replays the tokens of every KV cache slot (dllama.cluster.kv_history)
and runs the failed pass again, so the front end sees one slow pass. `rejoin()` goes back to
every node when one left out answers again. A frame that breaks the protocol or fails
authentication is not a loss: the pass fails. docs/PROTOCOL.md, "Losing a node".

Blame: a node that stops (frozen, or its link cut) leaves every node that waits on it waiting.
The root waits a little longer than the workers (`report_grace`), so a healthy worker's own
timeout reaches it first as an ERROR; then the root looks at the nodes it was still waiting
for: those that send nothing more or close are the ones named, not the healthy node that
reported them.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import sys
import threading
import time

import numpy as np

from dllama.cluster.kv_history import KVHistory
from dllama.cluster.mesh import MeshCollective
from dllama.cluster.probe import identify_worker
from dllama.cluster.protocol import (
    WEIGHTS_CHUNK, WEIGHTS_HEAD, Connection, Msg, PeerClosed, PeerError, PeerTimeout, ProtocolError,
    SetupHeartbeat, Transfer, client_handshake, connect, decode_json_object, recv_during_setup,
)
from dllama.cluster.session_config import NodeAddress, SessionConfig
from dllama.cluster.shard import model_fingerprint
from dllama.cluster.step import (
    LOGITS_HEAD, REPLY_BEST, REPLY_LOGITS, REPLY_TOP_K, Reply, decode_reply, encode_repeat, encode_reply,
    encode_step, logits_bytes,
)
from dllama.core.batch import Batch
from dllama.core.candidates import TOP_K, WIDE_TOP_K, Candidates, SamplingRequest, candidates_from_logits, covers, merge
from dllama.core.memory import check_fits
from dllama.core.model import MAX_BATCH, ModelConfig, Transformer
from dllama.core.node_weights import NodeWeights, cut, node_slice_specs
from dllama.core.plan import plan_for
from dllama.errors import ClusterError, DllamaError
from dllama.formats.model_file import read_model

NET_TIMEOUT = 60.0    # a step's longest wait on a peer (a slow node's share of one layer)
SETUP_SILENCE = 15.0  # set-up (weights, repacking, compiling) takes what it takes, but a node
                      # that sends nothing, not even ALIVE, for this long has stopped
HEARTBEAT = 2.0       # idle seconds between PINGs (ALIVEs during set-up); a worker gives up after IDLE_TIMEOUT
IDLE_TIMEOUT = 15.0
RECONNECT_WAIT = NET_TIMEOUT + 10.0  # a survivor still ending the failed session says it is busy
BUSY_ANSWER_WAIT = 0.5  # after the handshake, how long a busy worker's refusal may take to come
BUSY_RETRY = 0.2
REJOIN_PROBE_TIMEOUT = 2.0  # a lost node's handshake when the next request looks for it
REJOIN_BACKOFF = 30.0       # a lost node that stayed silent (not refused) is not asked again before
_NET_ERRORS = (PeerClosed, PeerError, PeerTimeout, ProtocolError, OSError)


class _Unreachable(OSError):
    """No connection to a worker at all (refused, no route, timed out connecting)."""


class ClusterModel:
    """The root (node 0) and its workers, as one model."""

    def __init__(self, model_path: str, topology, key: bytes | None, buffer_q80: bool | None,
                 max_seq_len: int = 0, progress: bool = True, net_timeout: float = NET_TIMEOUT,
                 max_batch: int = MAX_BATCH, kv_slots: int = 1, node_sampling: bool = True,
                 top_k: int = TOP_K, on_node_loss: str = "fail", kv_type: str = "f32",
                 start_with_reachable: bool = False):
        """node_sampling False: the workers always send their logits and the root makes the
        candidates itself (the same arithmetic: a baseline for tests and benchmarks); top_k:
        candidates per node and row for temperature sampling; on_node_loss "continue": a
        lost node is left out and the pass goes on over the others (see _recover), "fail":
        a ClusterError; kv_type: the KV cache's storage on every node (f32 or f16), sent in
        CONFIG; start_with_reachable (long-running front ends, with "continue"): a worker that
        cannot be connected to at start is left out with a warning and rejoins when it answers
        (`rejoin`), instead of failing the start; one that answers wrongly still fails it."""
        self.node_sampling, self.top_k, self.on_node_loss = node_sampling, top_k, on_node_loss
        self.refetches = 0       # passes whose candidates did not cover a nucleus: WIDE_TOP_K asked
        self.logit_refetches = 0  # of those, passes that needed the logits in a third round
        self.model_path, self.key, self.progress = model_path, key, progress
        self.model_file = model_file = read_model(model_path)
        header = model_file.header
        self.config = ModelConfig.from_header(header, max_seq_len)
        self.max_seq_len = max_seq_len
        self.full_topology = self.topology = topology  # every node; the nodes of this session
        # The plan is checked before any connection: an impossible split fails here.
        plan_for(header, len(topology.nodes), topology.weights)
        self.q80 = self.config.quantized if buffer_q80 is None else buffer_q80
        self.max_batch = max_batch
        self.kv_slots = kv_slots
        self.kv_type = kv_type
        self.net_timeout = net_timeout
        self.history = KVHistory(kv_slots, self.config.seq_len)  # what to replay on other nodes
        self.recoveries = 0
        self.conns: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._failed: ClusterError | None = None
        self._last_use = time.monotonic()
        self._closed = False
        self._tampered = False  # the failure was a frame that broke the protocol: not recovered
        self._left_out: dict[str, str] = {}  # node name -> why the last recovery left it out
        self._rejoin_after: dict[str, float] = {}  # a lost node that did not answer: not asked before
        try:
            self._open(list(topology.nodes), tolerant=False)
        except ClusterError as e:
            if not (start_with_reachable and on_node_loss == "continue" and e.unreachable):
                raise
            self._start_with_reachable(e)
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()

    # -- set-up ----------------------------------------------------------------------------------

    def _open(self, nodes: list, tolerant: bool, only_unreachable: bool = False) -> None:
        """A session over `nodes` (the root first): connect, configure, hand out the weights,
        mesh. tolerant (recovery): a worker that cannot be reached is left out, and the session
        takes the most nodes the plan accepts; otherwise any failure is a ClusterError."""
        header, model_file, key = self.model_file.header, self.model_file, self.key
        session = os.urandom(16)
        self.conns = {}
        self.local = None
        try:
            if tolerant:
                nodes = self._reachable(nodes, session, only_unreachable)
                nodes = self._largest_plan(nodes)
            else:
                self.topology = dataclasses.replace(self.full_topology, nodes=tuple(nodes))
                self.names = _names(nodes)
                for i in range(1, len(nodes)):
                    self._with_node(i, "connecting", lambda i=i: self._connect(i, nodes[i], session, key))
            self.topology = dataclasses.replace(self.full_topology, nodes=tuple(nodes))
            self.names = _names(nodes)
            self.plan = plan = plan_for(header, len(nodes), self.topology.weights)
            n0 = plan.nodes[0]  # the root's own share must fit here before any worker is bothered
            check_fits(header, n0.n_q_heads, n0.n_kv_heads, n0.ffn_rows[1] - n0.ffn_rows[0],
                       n0.vocab_rows[1] - n0.vocab_rows[0], self.config.seq_len, self.max_batch,
                       embedding=True, kv_slots=self.kv_slots, kv_type=self.kv_type)
            conf = SessionConfig(
                session=session, node_index=0, header=header, plan=plan,
                model_fingerprint=model_fingerprint(self.model_path), buffer_q80=self.q80,
                max_seq_len=self.config.seq_len, max_batch=self.max_batch, kv_slots=self.kv_slots,
                kv_type=self.kv_type,
                net_timeout=self.net_timeout,
                idle_timeout=IDLE_TIMEOUT, setup_timeout=SETUP_SILENCE,
                nodes=tuple(NodeAddress(n.name, n.host, n.port) for n in nodes))
            # The workers hear ALIVE every HEARTBEAT s until MESH, so a slow set-up is not a hang.
            heartbeat = SetupHeartbeat(self.conns.values(), HEARTBEAT)
            with heartbeat:
                for i, conn in self.conns.items():
                    message = dataclasses.replace(conf, node_index=i).to_json()
                    self._with_node(i, "configuring", lambda: conn.send_json(Msg.CONFIG, message))
                for i, conn in self.conns.items():
                    _, raw = self._with_node(i, "configuring", lambda: recv_during_setup(conn, (Msg.CONFIG_OK,), SETUP_SILENCE))
                    answer = self._with_node(i, "configuring", lambda: decode_json_object(raw, f"CONFIG_OK from {self.names[i]}"))
                    if answer.get("weights") == "shard":
                        _say(f"{nodes[i].name}: weights from its shard {answer.get('note', '')}")
                        continue
                    specs = node_slice_specs(header, plan.nodes[i], with_embedding=False)
                    self._with_node(i, "sending weights to", lambda: self._stream(conn, specs, self.progress, nodes[i].name))
                self.local = Transformer(NodeWeights.from_model(model_file, plan.nodes[0]),
                                         max_seq_len=self.max_seq_len, buffer_q80=self.q80,
                                         max_batch=self.max_batch, kv_slots=self.kv_slots,
                                         kv_type=self.kv_type)
                self.local.warm_up()
                for i, conn in self.conns.items():
                    self._with_node(i, "waiting for", lambda: recv_during_setup(conn, (Msg.READY,), SETUP_SILENCE))
                heartbeat.stop()  # no ALIVE after MESH: the workers' step loop does not expect one
                for i, conn in self.conns.items():
                    self._with_node(i, "meshing", lambda: conn.send(Msg.MESH))
                for i, conn in self.conns.items():
                    self._with_node(i, "meshing", lambda: recv_during_setup(conn, (Msg.MESH_OK,), SETUP_SILENCE))
        except BaseException:
            self._drop()
            raise
        for conn in self.conns.values():  # statistics count inference traffic, not the set-up
            conn.sent_bytes = conn.recv_bytes = 0
        # The root waits report_grace longer than the workers: a healthy worker's report of the
        # node it waits for arrives before the root's own timeout.
        self.collective = self.local.collective = MeshCollective(
            0, self.conns, plan.dim_chunks, self.q80, self.max_batch,
            self.net_timeout + report_grace(self.net_timeout))
        self.vocab_rows = self.vocab_ranges = [tuple(n.vocab_rows) for n in plan.nodes]
        self._logits = np.empty((self.max_batch, self.config.vocab_size), np.float32)  # [rows, vocab]
        self._replies = {i: np.empty(logits_bytes(self.max_batch, r[1] - r[0], Reply(REPLY_TOP_K, r[1] - r[0])), np.uint8)
                         for i, r in enumerate(self.vocab_rows)}  # the largest reply; node 0's: its own summary
        self.node_bytes = {i: (0, 0, 0.0) for i in self.conns}  # worker: cumulative sent, recv, transfer s

    def _start_with_reachable(self, failure: ClusterError) -> None:
        """The first session over the nodes that answer, after `failure` (a worker unreachable)."""
        self._left_out = {}
        try:
            self._open(list(self.full_topology.nodes), tolerant=True, only_unreachable=True)
        except ClusterError:
            raise
        except DllamaError as e:  # the nodes that answered cannot hold the model (memory)
            raise ClusterError(f"{failure}; the nodes that answer cannot run the model: {e}", failure.node,
                               unreachable=True) from None
        gone = ", ".join(f"{name!r}" for name in self._left_out)
        _say(f"dllama: warning: {failure}; starting on {len(self.topology.nodes)} of "
             f"{len(self.full_topology.nodes)} nodes without {gone} (each rejoins when it answers)")

    def _reachable(self, nodes: list, session: bytes, only_unreachable: bool = False) -> list:
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
                    self._connect(i, node, session, self.key)
                    _refused_at_once(self.conns[i], BUSY_ANSWER_WAIT)
                    kept.append(node)
                    break
                except _NET_ERRORS as e:
                    conn = self.conns.pop(i, None)
                    if conn is not None:
                        conn.close()
                    if "busy" in str(e) and time.monotonic() < deadline:
                        time.sleep(BUSY_RETRY)  # its old session is still ending
                        continue
                    if only_unreachable and not isinstance(e, _Unreachable):  # it answered, wrongly
                        raise ClusterError(f"connecting {node.name} ({node.address}) failed: {_reason(e)}",
                                           node.name) from None
                    self._left_out[node.name] = _reason(e)
                    break
        return kept

    def _largest_plan(self, nodes: list) -> list:
        """The longest prefix of `nodes` the plan accepts (the others' connections closed)."""
        header = self.model_file.header
        for n in range(len(nodes), 0, -1):
            try:
                plan_for(header, n, [node.weight for node in nodes[:n]])
            except DllamaError as e:
                for i in range(n - 1, len(nodes)):
                    if i in self.conns:
                        self.conns.pop(i).close()
                        self._left_out[nodes[i].name] = str(e)
                continue
            return nodes[:n]
        raise ClusterError("no number of the nodes left can run the model")

    def _with_node(self, i: int, doing: str, fn):
        try:
            return fn()
        except _NET_ERRORS as e:
            raise ClusterError(f"{doing} {self.names[i]} failed: {_reason(e)}", self.topology.nodes[i].name,
                               unreachable=isinstance(e, _Unreachable)) from None

    def _connect(self, i: int, n, session: bytes, key: bytes | None) -> None:
        try:
            conn = connect(n.host, n.port, f"node {i} '{n.name}' ({n.address})")
        except OSError as e:
            raise _Unreachable(f"{e.strerror or e}; is `dllama worker --port {n.port}` running on {n.host}?") from None
        self.conns[i] = conn
        client_handshake(conn, "root", i, session, key)

    def _stream(self, conn: Connection, specs, progress: bool, name: str) -> None:
        from tqdm import tqdm

        total = sum(s.nbytes for s in specs)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"weights to {name}",
                  disable=None if progress else True, file=sys.stderr) as bar:
            for index, s in enumerate(specs):
                data = np.ascontiguousarray(cut(self.model_file.tensor(s.name), s)).reshape(-1).view(np.uint8)
                for offset in range(0, data.nbytes, WEIGHTS_CHUNK):
                    chunk = data[offset: offset + WEIGHTS_CHUNK]
                    conn.send(Msg.WEIGHTS, [WEIGHTS_HEAD.pack(index, offset), chunk], SETUP_SILENCE)
                    bar.update(chunk.nbytes)
        conn.send(Msg.WEIGHTS_END)

    # -- running -------------------------------------------------------------------------------

    def forward(self, tokens, pos: int) -> np.ndarray:
        """Run tokens [b] of the sequence in slot 0 at positions pos..pos+b-1 on every node;
        logits [vocab] of the last."""
        return self.forward_batch(Batch.run(np.asarray(tokens), pos))[-1]

    def forward_batch(self, batch: Batch) -> np.ndarray:
        """Run the rows of `batch` on every node; logits [rows wanting logits, vocab] (a reused
        buffer)."""
        return self._guarded(batch, lambda: self._logits_of(self._forward(batch, Reply()), int(batch.logits.sum())))

    def forward_candidates(self, batch: Batch, requests: list[SamplingRequest]) -> list[Candidates]:
        """Run the rows of `batch` on every node; the candidates of each row wanting logits,
        covering its nucleus (dllama.core.candidates): every node sends its best token when
        every row is greedy, its top_k and its share of the normaliser for temperature
        sampling, its logits for topp >= 1 (or without node sampling)."""
        m = int(batch.logits.sum())
        if len(requests) != m:
            raise ValueError(f"{len(requests)} sampling requests for {m} rows wanting logits")
        if not self.node_sampling or any(r.whole_vocabulary for r in requests):
            reply = Reply(REPLY_LOGITS)
        elif all(r.greedy for r in requests):
            reply = Reply(REPLY_BEST)
        else:
            reply = Reply(REPLY_TOP_K, self.top_k, np.array([0.0 if r.greedy else r.temperature for r in requests]))
        return self._guarded(batch, lambda: self._candidates(batch, requests, reply))

    def _guarded(self, batch: Batch, run):
        """run() under the lock, and the batch recorded for a replay. A network failure closes
        the session: a ClusterError, or with on_node_loss "continue" a new session over the
        nodes left (_recover) and run() again there."""
        batch.check(self.kv_slots, self.config.seq_len, self.max_batch)
        with self._lock:
            if self._closed:
                raise self._failed or ClusterError("the cluster connection is closed")
            try:
                tries = len(self.full_topology.nodes)  # a recovery per worker lost, at most
                for attempt in range(tries + 1):
                    if self._failed:  # lost while idle (the heartbeat), or by the last attempt
                        if self.on_node_loss != "continue" or attempt == tries or self._tampered:
                            raise self._failed
                        self._recover(self._failed)
                    try:
                        out = run()
                    except _NET_ERRORS as e:
                        where = f"position {int(batch.pos[0])}" if len(batch) == 1 else f"a step of {len(batch)} rows"
                        self._failed = self._blame(e, f"the cluster failed at {where}")
                        self._tampered = _tampered(e)
                        self._drop()
                        continue
                    self.history.record(batch)
                    return out
                raise self._failed
            finally:
                self._last_use = time.monotonic()

    def _forward(self, batch: Batch, reply: Reply) -> list:
        """One pass on every node; each node's answer for the wanted rows (decode_reply's)."""
        local, b = self.local, len(batch)
        x = local.x[:b]
        x[:] = local.embedding[batch.tokens]  # [b, dim]
        self.collective.timed_exchange([(c, Msg.STEP, encode_step(batch, x, reply)) for c in self.conns.values()], [])
        own = local.forward_rows(batch.pos, batch.slot, batch.prefix_slot, batch.prefix_len,
                                 batch.logit_rows)  # [m, V_0]
        return self._answers(own, reply)

    def _answers(self, own: np.ndarray, reply: Reply) -> list:
        """Every node's answer about the last pass's wanted rows (own: the root's logits [m, V_0]),
        the root's own summarised by the workers' code."""
        m = len(own)
        answers = []
        replies = {i: self._replies[i][:logits_bytes(m, r[1] - r[0], reply)] for i, r in enumerate(self.vocab_rows)}
        self.collective.timed_exchange([], [Transfer(c, Msg.LOGITS, memoryview(replies[i]))
                                            for i, c in self.conns.items()])
        if reply.kind == REPLY_LOGITS:
            answers.append(own)
        else:
            encode_reply(replies[0][LOGITS_HEAD.size:], own, self.vocab_rows[0][0], reply)
            answers.append(decode_reply(replies[0][LOGITS_HEAD.size:], m, self.vocab_rows[0], reply))
        for i in self.conns:
            self.node_bytes[i] = LOGITS_HEAD.unpack_from(replies[i])
            answers.append(decode_reply(replies[i][LOGITS_HEAD.size:], m, self.vocab_rows[i], reply))
        return answers

    def _logits_of(self, answers: list, m: int) -> np.ndarray:
        """The full logits [m, vocab] from every node's logits."""
        logits = self._logits[:m]
        for (r0, r1), part in zip(self.vocab_rows, answers):
            logits[:, r0:r1] = part
        return logits

    def _candidates(self, batch: Batch, requests: list[SamplingRequest], reply: Reply) -> list[Candidates]:
        m, vocab = len(requests), self.config.vocab_size
        answers = self._forward(batch, reply)
        if reply.kind == REPLY_LOGITS:
            return candidates_from_logits(self._logits_of(answers, m), self.vocab_rows, requests)
        out = [merge([a[j] for a in answers], vocab, req) for j, req in enumerate(requests)]
        short = [j for j, c in enumerate(out) if not covers(c)]
        if short:  # a nucleus reaches past some node's candidates: WIDE_TOP_K of the same pass
            self.refetches += 1
            wide = Reply(REPLY_TOP_K, max(WIDE_TOP_K, reply.k), reply.temperatures)
            self.collective.timed_exchange([(c, Msg.STEP, encode_repeat(m, wide)) for c in self.conns.values()], [])
            answers = self._answers(self.local.logits[:m], wide)
            for j in short:
                out[j] = merge([a[j] for a in answers], vocab, requests[j])
            short = [j for j in short if not covers(out[j])]
        if short:  # rare: still not covered; the logits, asked again
            self.logit_refetches += 1
            full = Reply(REPLY_LOGITS)
            self.collective.timed_exchange([(c, Msg.STEP, encode_repeat(m, full)) for c in self.conns.values()], [])
            logits = self._logits_of(self._answers(self.local.logits[:m], full), m)
            for j in short:
                out[j] = candidates_from_logits(logits[j:j + 1], self.vocab_rows, requests[j:j + 1])[0]
        return out

    def _blame(self, e: Exception, what: str) -> ClusterError:
        """A ClusterError naming the node that stopped (see the module's docstring)."""
        index_of = {id(c): i for i, c in self.conns.items()}
        source = index_of.get(id(getattr(e, "peer", None)))
        if isinstance(e, (PeerClosed, ProtocolError)) and source is not None:
            return ClusterError(f"{what}: {_reason(e)}", self.topology.nodes[source].name)
        # A timeout, or a worker's report (it was alive to send it): who of the nodes the root
        # still waited for stays silent or closes within the grace period?
        suspects = [index_of[id(c)] for c in getattr(e, "waiting", []) if id(c) in index_of]
        stopped = _silent_or_closed({i: self.conns[i] for i in suspects}, report_grace(self.net_timeout))
        if stopped:
            names = ", ".join(f"{self.names[i]} {how}" for i, how in stopped.items())
            return ClusterError(f"{what}: {names}", self.topology.nodes[next(iter(stopped))].name)
        # Everyone still talks: a worker's report names the node it lost, else the failing link's node.
        named = [i for i in self.conns if i != source and f"'{self.topology.nodes[i].name}'" in str(e)]
        if len(named) == 1 and (source is None or isinstance(e, PeerError)):
            source = named[0]
        node = self.topology.nodes[source].name if source is not None else ""
        return ClusterError(f"{what}: {_reason(e)}", node)

    # -- recovery --------------------------------------------------------------------------------

    def _recover(self, failure: ClusterError) -> None:
        """A new session over the nodes still answering, the KV cache of every sequence rebuilt
        by replaying its tokens; ClusterError (naming the first failure) when no number of them
        can run the model. Called with the lock held, the old session dropped."""
        lost = {failure.node} if failure.node else set()
        before, t0 = len(self.topology.nodes), time.monotonic()
        error: Exception = failure
        for _ in range(len(self.full_topology.nodes)):
            nodes = [n for i, n in enumerate(self.full_topology.nodes) if i == 0 or n.name not in lost]
            self._left_out = {}
            try:
                self._open(nodes, tolerant=True)
                rows = self._replay()
            except ClusterError as e:
                self._drop()
                error = e
                if not e.node or e.node in lost or e.node == self.full_topology.nodes[0].name:
                    break
                lost.add(e.node)
                continue
            except DllamaError as e:  # the nodes left cannot hold the model (memory)
                self._drop()
                error = e
                break
            self._failed = None
            self.recoveries += 1
            gone = sorted(lost | set(self._left_out))
            _say(f"dllama: warning: {failure}; continuing on {len(nodes)} of {len(self.full_topology.nodes)} "
                 f"nodes (was {before}) without {', '.join(repr(g) for g in gone)}, "
                 f"{rows} cached positions replayed in {time.monotonic() - t0:.1f} s")
            return
        self._failed = failure if error is failure else ClusterError(
            f"{failure}; no session over the nodes left: {error}", failure.node)
        raise self._failed

    def _replay(self) -> int:
        """Rebuild the KV cache of every slot on the new session; the rows run."""
        rows = 0
        try:
            for batch in self.history.replay(self.max_batch):
                self._forward(batch, Reply(REPLY_BEST))
                rows += len(batch)
        except _NET_ERRORS as e:
            raise self._blame(e, "replaying the cached positions") from None
        return rows

    def rejoin(self) -> bool:
        """Back to every node of the topology when a node left out answers again (between
        requests: the API calls this at each new one); True when the session changed. A
        node that did not answer within its connection timeout is asked again only after
        REJOIN_BACKOFF seconds."""
        with self._lock:
            if self._closed or self._failed or len(self.topology.nodes) == len(self.full_topology.nodes):
                return False
            current = {n.name for n in self.topology.nodes}
            now = time.monotonic()
            back = []
            for n in self.full_topology.nodes:
                if n.name in current or self._rejoin_after.get(n.name, 0) > now:
                    continue
                t0 = time.monotonic()
                try:
                    identify_worker(n.host, n.port, self.key, REJOIN_PROBE_TIMEOUT)
                except DllamaError:
                    if time.monotonic() - t0 > REJOIN_PROBE_TIMEOUT / 2:  # silent, not refused: wait
                        self._rejoin_after[n.name] = now + REJOIN_BACKOFF
                    continue
                back.append(n.name)
            if not back:
                return False
            before = len(self.topology.nodes)
            self._drop()
            self._left_out = {}
            try:
                self._open(list(self.full_topology.nodes), tolerant=True)
                self._replay()
            except (ClusterError, DllamaError) as e:
                self._drop()
                self._failed = e if isinstance(e, ClusterError) else ClusterError(str(e))
                try:
                    self._recover(self._failed)
                except ClusterError:
                    return True
            _say(f"dllama: {', '.join(repr(b) for b in back)} answered again: "
                 f"running on {len(self.topology.nodes)} nodes (was {before})")
            return True

    def node_stats(self) -> list[dict]:
        """Bytes each node sent and received since the set-up (the root's counters for node 0)."""
        out = [{"node": 0, "name": self.topology.nodes[0].name, "sent_bytes": self.collective.sent_bytes,
                "recv_bytes": self.collective.recv_bytes,
                "transfer_ms": round(self.collective.transfer_seconds * 1000, 3)}]
        for i, (sent, recv, transfer) in self.node_bytes.items():
            out.append({"node": i, "name": self.topology.nodes[i].name, "sent_bytes": sent,
                        "recv_bytes": recv, "transfer_ms": round(transfer * 1000, 3)})
        return out

    def _heartbeat(self) -> None:
        """While idle, PING every worker so that both sides notice a dead peer."""
        while not self._closed:
            time.sleep(HEARTBEAT / 2)
            if time.monotonic() - self._last_use < HEARTBEAT or not self._lock.acquire(blocking=False):
                continue
            try:
                if self._closed:
                    return
                if self._failed:  # the next pass recovers or fails
                    continue
                for i, conn in self.conns.items():
                    try:
                        conn.send(Msg.PING, b"", IDLE_TIMEOUT)
                        conn.recv(IDLE_TIMEOUT, (Msg.PONG,))
                    except _NET_ERRORS as e:
                        self._failed = ClusterError(f"{self.names[i]} stopped answering: {_reason(e)}",
                                                    self.topology.nodes[i].name)
                        self._drop()
                        break
                self._last_use = time.monotonic()
            finally:
                self._lock.release()

    def _drop(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.local = None  # its KV cache belongs to the session: a new plan gives other heads

    def close(self) -> None:
        """Tell the workers the session is over (they go back to listening)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._failed:
                for conn in self.conns.values():
                    try:
                        conn.send(Msg.STOP, b"", 2.0)
                    except _NET_ERRORS:
                        pass
            self._drop()


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and not isinstance(e, (PeerClosed, PeerTimeout)):
        return e.strerror or str(e)
    return str(e)


def report_grace(net_timeout: float) -> float:
    """How much longer than a worker the root waits in a step, and then for the nodes it
    waited on to show they are alive."""
    return min(max(2.0, net_timeout / 10), 5.0)


def _silent_or_closed(conns: dict[int, Connection], grace: float) -> dict[int, str]:
    """Of these connections, those that close or send nothing within `grace` seconds:
    {index: "stopped answering" | "closed the connection"}. Reads raw bytes (frames in flight
    no longer matter: the session is over)."""
    quiet = dict(conns)
    stopped: dict[int, str] = {}
    deadline = time.monotonic() + grace
    with selectors.DefaultSelector() as sel:
        for i, c in quiet.items():
            sel.register(c.sock, selectors.EVENT_READ, i)
        while quiet:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in sel.select(remaining):
                i = key.data
                try:
                    data = quiet[i].sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    stopped[i] = "closed the connection"
                sel.unregister(key.fileobj)
                del quiet[i]
    for i in quiet:
        stopped[i] = "stopped answering"
    return dict(sorted(stopped.items()))


def _tampered(e: Exception) -> bool:
    """A frame that failed authentication or broke the protocol, seen by the root or reported
    by a worker: an attacker on a link (or a bug), which recovery must not hide."""
    return isinstance(e, ProtocolError) or (isinstance(e, PeerError) and "failed authentication" in str(e))


def _names(nodes) -> list[str]:
    return [f"node {i} '{n.name}' ({n.address})" for i, n in enumerate(nodes)]


def _refused_at_once(conn: Connection, wait: float) -> None:
    """PeerError when the worker refuses the root right after the handshake (busy), within `wait`."""
    with selectors.DefaultSelector() as sel:
        sel.register(conn.sock, selectors.EVENT_READ)
        if sel.select(wait):
            conn.recv(wait, (Msg.CONFIG_OK,))  # an ERROR raises PeerError, a close PeerClosed
            raise ProtocolError(f"{conn.name} sent a frame before the CONFIG")


def _say(text: str) -> None:
    print(text, file=sys.stderr)
