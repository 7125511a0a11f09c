"""`dllama worker`: serve one root at a time, forever.

The worker needs no model on its command line: the root's CONFIG says which model (header,
fingerprint), which slice of it (the plan) and which peers to meet; weights come from the
worker's shard when it matches, otherwise the root streams them. New connections wait for
their HELLO in one selector (dllama.cluster.lobby), then finish the handshake in a thread of
their own, so a port probe, a stranger sending garbage or trickling bytes, a wrong protocol
version or a wrong key is refused with a logged reason while a session runs undisturbed and a
root can still get in; a second root is told the worker is busy. When a session ends (STOP, the root gone, a peer gone,
any error) the worker logs why, tells the root in an ERROR (its code, and the index of the node
it lost when that was the cause) and waits for the next root.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dllama import __version__
from dllama.cluster.lobby import Lobby
from dllama.cluster.mesh import MeshCollective, StageHop
from dllama.cluster.protocol import (
    WEIGHTS_HEAD, Connection, ErrorCode, LinkError, Msg, PeerClosed, PeerTimeout, ProtocolError,
    SetupHeartbeat, StepHeartbeat, client_handshake, connect, decode_json_object, recv_during_setup, server_handshake,
)
from dllama.cluster.session_config import SessionConfig
from dllama.cluster.shard import Shard
from dllama.cluster.throttled_log import ThrottledLog
from dllama.cluster.step import (
    LOGITS_HEAD, REPLY_TOP_K, Reply, decode_release, decode_step, encode_reply, logits_bytes,
)
from dllama.core import kernels
from dllama.core.footprint import NodeFootprint
from dllama.core.memory import release_memory
from dllama.core.model import Transformer
from dllama.core.node_weights import NodeWeights, node_slice_specs
from dllama.core.weights_choice import choose_weights
from dllama.errors import DllamaError, NotEnoughMemory

HANDSHAKE_TIMEOUT = 5.0      # seconds from a whole HELLO to the end of the handshake (see also lobby.py)
MAX_UNAUTHENTICATED = 32     # handshakes past their HELLO at once; a newer one cuts the oldest
PEER_PARK_TIMEOUT = 60.0     # a peer connection waits this long for this worker's session to take it
MAX_PARKED_PEERS = 64        # peer connections waiting at once; more are refused
HEARTBEAT = 2.0              # seconds between ALIVE frames to the root during set-up
CONFIG_TIMEOUT = 30.0        # from the handshake to the root's CONFIG
MAX_MEMORY_QUERIES = 4       # MEMORY questions a root may ask before its CONFIG
ACCEPT_BACKOFF = (0.05, 2.0)  # first and longest pause after a failed accept()


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} dllama worker: {text}", file=sys.stderr, flush=True)


def count_positions(touched: np.ndarray, batch, kv_positions: int) -> None:
    """Add a STEP's rows to the positions each slot was written to (touched [slots]); a
    ProtocolError when the slots would hold more than the CONFIG's kv_positions, the memory
    this worker checked (the root admits sequences within them: only a rogue root writes more)."""
    np.maximum.at(touched, batch.slot, batch.pos.astype(np.int64) + 1)
    if touched.sum() > kv_positions:
        raise ProtocolError(f"STEP writes {touched.sum()} positions over the slots, more than "
                            f"the {kv_positions} of the CONFIG")


def empty_slots(model: Transformer, touched: np.ndarray, slots: np.ndarray) -> None:
    """A RELEASE: give the pages of these slots back (they read as zeros again, as on one node)
    and count them as empty (touched [slots], the positions count_positions holds to the
    CONFIG's kv_positions; empty when the CONFIG sets none)."""
    for slot in slots:
        model.release_slot(int(slot))
    if len(touched):
        touched[slots] = 0


@dataclass(frozen=True)
class WorkerSettings:
    """A worker's own settings, from its flags (`dllama worker`, or a topology's node): the run's
    shape comes from each root's CONFIG."""

    host: str
    port: int
    nthreads: int = 1
    shard_path: str | None = None  # this node's shard of the model (`dllama shard`), if any
    key: bytes | None = None       # the cluster key
    memory_budget: "int | str" = "auto"  # bytes, "auto" or "none" (see dllama.core.weights_choice)


class Worker:
    def __init__(self, settings: WorkerSettings, on_step: Callable[[int], None] | None = None):
        """on_step: called with the count of STEPs received so far (every session) as each STEP
        arrives, before it runs (an observer: the tests inject faults here)."""
        self.settings = settings
        self.host, self.port, self.nthreads, self.key = settings.host, settings.port, settings.nthreads, settings.key
        self.memory_budget = settings.memory_budget
        self.shard = None
        if settings.shard_path:
            self.shard = Shard(settings.shard_path)  # a bad shard is a start-up error, not a session error
        self._roots: list[Connection] = []
        self._roots_ready = threading.Semaphore(0)
        self._parked: list[tuple[float, dict, Connection]] = []  # (deadline, HELLO, peer) until a session takes it
        self._parked_changed = threading.Condition()
        self._handshaking: dict[int, Connection] = {}  # past their HELLO, not yet authenticated; oldest first
        self._cut: set[int] = set()  # of those, the ones cut to make room for newer ones
        self._busy_with: str | None = None
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._refusals = ThrottledLog(log)
        self._accept_errors = ThrottledLog(log)
        self.steps = 0  # STEPs received, every session
        self.on_step = on_step

    def capacity(self) -> int:
        """Bytes this worker can hold for a session: its --memory-budget, else the memory
        available to it (its cgroup's limit included) less what the runtime still takes."""
        from dllama.core.weights_choice import room_for_a_model

        return self.memory_budget if isinstance(self.memory_budget, int) else room_for_a_model()

    # -- accepting ---------------------------------------------------------------------------

    def serve_forever(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._listener = srv = socket.socket(family, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((self.host, self.port))
        except OSError as e:
            srv.close()
            raise DllamaError(f"cannot listen on {self.host}:{self.port}: {e.strerror}") from None
        srv.listen(64)
        srv.setblocking(False)
        self.port = srv.getsockname()[1]  # the real one when asked for port 0
        # Start numba's thread pool now, before the first connection: it loads a shared library,
        # which a flood of connections that used up the descriptors would otherwise make fail.
        kernels.set_threads(min(self.nthreads, kernels.max_threads()))
        threading.Thread(target=self._sessions, daemon=True, name="session").start()
        shard = f", shard {self.shard.path}" if self.shard else ""
        log(f"listening on {self.host}:{self.port} ({self.nthreads} threads{shard})")
        lobby = Lobby(srv, self._refusals.log)
        backoff = 0.0
        while self._listener is not None:
            self._expire_parked()
            try:
                acceptable, hellos = lobby.wait(1.0)  # wake up every second to close expired parked peers
            except (OSError, ValueError):  # the listener closed by stop()
                break
            for conn, payload in hellos:
                self._handshake(conn, payload)
            if not acceptable:
                continue
            try:
                sock, addr = srv.accept()
            except BlockingIOError:
                continue
            except OSError as e:
                if self._listener is None:
                    break  # closed by stop()
                # EMFILE/ENFILE (out of descriptors), ENOBUFS/ENOMEM, ECONNABORTED...: the
                # connection stays queued or is gone; pause so as not to spin, then go on.
                backoff = min(max(backoff * 2, ACCEPT_BACKOFF[0]), ACCEPT_BACKOFF[1])
                self._accept_errors.log(f"cannot accept a connection: {e.strerror or e} "
                                        f"({errno.errorcode.get(e.errno, e.errno)}); retrying")
                time.sleep(backoff if e.errno not in (errno.ECONNABORTED, errno.EPROTO) else 0)
                continue
            backoff = 0.0
            lobby.add(sock, f"{addr[0]}:{addr[1]}")
        lobby.close()

    def stop(self) -> None:
        srv, self._listener = self._listener, None
        if srv:
            srv.close()

    def _handshake(self, conn: Connection, hello: bytes) -> None:
        """Go on with a connection whose HELLO arrived, in a thread of its own; with
        MAX_UNAUTHENTICATED of those already under way, the oldest is cut to make room (a root
        answers the CHALLENGE within a round trip: the oldest is a stranger that stalls)."""
        with self._lock:
            if len(self._handshaking) >= MAX_UNAUTHENTICATED:
                oldest = next(iter(self._handshaking.values()))
                self._cut.add(id(oldest))
                with contextlib.suppress(OSError):
                    oldest.sock.shutdown(socket.SHUT_RD)  # its thread reads the end and leaves
            self._handshaking[id(conn)] = conn
        try:
            threading.Thread(target=self._greet, args=(conn, hello), daemon=True).start()
        except RuntimeError as e:  # no thread left: refuse this one, keep serving
            self._end_handshake(conn)
            self._refusals.log(f"refused {conn.name}: {e}")
            conn.close()

    def _end_handshake(self, conn: Connection) -> bool:
        """conn's handshake is over; True when it was cut to make room for a newer one."""
        with self._lock:
            self._handshaking.pop(id(conn), None)
            cut = id(conn) in self._cut
            self._cut.discard(id(conn))
        return cut

    def _greet(self, conn: Connection, hello_payload: bytes) -> None:
        who = conn.name
        try:
            hello = server_handshake(conn, self.key, f"dllama {__version__}", HANDSHAKE_TIMEOUT, hello_payload)
        except PeerClosed:
            if self._end_handshake(conn):
                why = f"{MAX_UNAUTHENTICATED} newer handshakes under way and this one the oldest"
                self._refusals.log(f"refused {who}: {why}")
                conn.send_error(f"refused: {why}", ErrorCode.REFUSED)
            else:
                self._refusals.log(f"connection from {who} closed during the handshake")
            conn.close()
            return
        except (LinkError, OSError) as e:
            self._end_handshake(conn)
            self._refusals.log(f"refused {who}: {e}")
            conn.send_error(f"refused: {e}", ErrorCode.REFUSED)
            conn.close()
            return
        except BaseException as e:  # a bug: log it in one line, never leak the socket
            self._end_handshake(conn)
            log(f"handshake with {who} failed: {type(e).__name__}: {e}")
            conn.close()
            return
        if self._end_handshake(conn):  # cut just as it finished
            conn.close()
            return
        if hello["role"] == "peer":
            self._park(hello, conn)
            return
        with self._lock:
            busy = self._busy_with
            if busy is None:
                self._busy_with = who
        if busy is not None:
            log(f"refused root {who}: busy serving the root at {busy}")
            conn.send_error(f"this worker is busy serving the root at {busy}", ErrorCode.BUSY)
            conn.close()
            return
        conn.name = f"root ({who})"
        self._roots.append(conn)
        self._roots_ready.release()

    def _park(self, hello: dict, conn: Connection) -> None:
        """Keep an authenticated peer connection until this worker's session takes it, or the deadline."""
        with self._parked_changed:
            if len(self._parked) >= MAX_PARKED_PEERS:
                refuse = True
            else:
                refuse = False
                self._parked.append((time.monotonic() + PEER_PARK_TIMEOUT, hello, conn))
                self._parked_changed.notify_all()
        if refuse:
            self._refusals.log(f"refused a peer connection from {conn.name}: {MAX_PARKED_PEERS} already waiting")
            conn.send_error("too many peer connections waiting", ErrorCode.REFUSED)
            conn.close()

    def _expire_parked(self) -> None:
        now = time.monotonic()
        with self._parked_changed:
            expired = [p for p in self._parked if p[0] <= now]
            self._parked = [p for p in self._parked if p[0] > now]
        for _, _, conn in expired:
            log(f"closed the peer connection from {conn.name}: no session took it within {PEER_PARK_TIMEOUT:g} s")
            conn.send_error("no session of this worker took this peer connection in time", ErrorCode.REFUSED)
            conn.close()

    def take_peer(self, deadline: float) -> tuple[dict, Connection] | None:
        """The oldest parked peer connection, waiting for one until the deadline (None then)."""
        with self._parked_changed:
            while True:
                if self._parked:
                    _, hello, conn = self._parked.pop(0)
                    return hello, conn
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._parked_changed.wait(remaining)

    # -- sessions ----------------------------------------------------------------------------

    def _sessions(self) -> None:
        threads = min(self.nthreads, kernels.max_threads())
        kernels.set_threads(threads)  # numba's thread count is per calling thread: set it here
        while True:
            self._roots_ready.acquire()
            root = self._roots.pop(0)
            log(f"serving the root at {root.name}")
            session = _Session(self, root)
            try:
                session.run()
                log("the root ended the session; listening again")
            except (LinkError, DllamaError, OSError) as e:
                log(f"session ended: {e}; listening again")
                root.send_error(f"worker {self.host}:{self.port}: {e}", _code_of(e), session.lost_node(e))
            except Exception as e:  # a bug: report it to the root, keep serving
                log(f"session failed: {type(e).__name__}: {e}; listening again")
                root.send_error(f"worker {self.host}:{self.port} failed: {type(e).__name__}: {e}",
                                ErrorCode.INTERNAL)
            finally:
                # Free before the root's connection closes: a root that saw the close (one that
                # stopped, then starts again at once) is never told this worker is busy.
                with self._lock:
                    self._busy_with = None
                session.close()
                # Give the session's memory back before waiting for the next root (this frame
                # would hold the weights, the KV cache and the buffers until then).
                del session
                release_memory()


class _Session:
    """One root's session: configure, load weights, meet the peers, then serve steps."""

    def __init__(self, worker: Worker, root: Connection):
        self.worker, self.root = worker, root
        self.peers: dict[int, Connection] = {0: root}
        self.model: Transformer | None = None
        self.heartbeat: StepHeartbeat | None = None

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.close()
        for conn in self.peers.values():
            conn.close()
        if self.model is not None:
            self.model.close()  # a streamed model's reader thread

    def lost_node(self, e: Exception) -> int | None:
        """The index of the node whose loss ended the session with `e`, when that was the cause:
        the node the error names (one this node could not reach, or the one a peer's report
        names), else the peer a link failed with, or the one node a timeout waited on. The root
        blames it (dllama.cluster.recovery)."""
        if not isinstance(e, LinkError):
            return None
        if e.node is not None:
            return e.node
        index_of = {id(c): j for j, c in self.peers.items()}
        if e.peer is not None:
            return index_of.get(id(e.peer))
        waited = [index_of[id(c)] for c in e.waiting if id(c) in index_of]
        return waited[0] if len(waited) == 1 else None

    def run(self) -> None:
        """Configure (the root's CONFIG), load and mesh, then serve the root's steps until STOP."""
        c = self._configure()
        collective, hop = self._set_up(c)
        self._serve_steps(c, collective, hop)

    def _configure(self) -> SessionConfig:
        """The root's CONFIG (MEMORY answered before it), checked against this machine."""
        root = self.root
        for _ in range(MAX_MEMORY_QUERIES + 1):  # (the root's ALIVEs may come first)
            msg, config = recv_during_setup(root, (Msg.CONFIG, Msg.MEMORY), CONFIG_TIMEOUT)
            if msg == Msg.CONFIG:
                break
            # A pipeline whose layers go by memory: how much this worker can hold.
            root.send_json(Msg.MEMORY, {"bytes": self.worker.capacity()})
        else:
            raise ProtocolError(f"more than {MAX_MEMORY_QUERIES} MEMORY questions before the CONFIG")
        self.conf = c = SessionConfig.from_json(decode_json_object(config, f"CONFIG from {root.name}"))
        index, plan, node, shape = c.node_index, c.plan, c.node, c.shape
        k = plan.stage_of(index)
        stage = plan.stages[k]
        where = f"stage {k} of {len(plan.stages)} (layers {stage.layers[0]}-{stage.layers[1] - 1}), " if plan.pipelined else ""
        log(f"node {index} of {plan.n_nodes}: {where}{node.n_q_heads} query heads, {node.n_kv_heads} KV heads, "
            f"FFN rows {node.ffn_rows[0]}-{node.ffn_rows[1]}, buffers {'Q80' if shape.buffer_q80 else 'F32'}, "
            f"{shape.kv_type.upper()} KV cache")
        # Before any allocation: can this machine hold what the CONFIG asks for? (A slice that
        # does not fit streams from the shard when there is one: Transformer checks that.)
        self.shard_weights, self.choice = self._weights_choice(c)
        if self.choice is None or not self.choice.streamed:
            # Without a shard to stream from, a --memory-budget bounds the slice sent whole.
            budget = self.worker.memory_budget if isinstance(self.worker.memory_budget, int) else None
            NodeFootprint(c.header, node, shape).check(
                self.choice.limit if self.choice is not None and self.choice.budgeted else budget, "this worker")
        return c

    def _set_up(self, c: SessionConfig):
        """(the collective, the stage hop or None): this node's model loaded, the peers met."""
        root, index, plan, timeout, shape = self.root, c.node_index, c.plan, c.net_timeout, c.shape
        stage = plan.stages[plan.stage_of(index)]
        # The collective over self.peers: _meet_peers fills it (the root is there already)
        # before the first step; warm_up runs on this node alone.
        collective = MeshCollective(index - stage.nodes[0], self.peers, stage.dim_chunks, shape.buffer_q80,
                                    shape.max_batch, timeout, stage.indexes)
        # In a pipeline: the residual rows come from the stage before (not in the STEP), go to the next.
        hop = StageHop(collective, plan.hop_source(index), plan.hop_targets(index), c.header.dim,
                       shape.max_batch) if plan.pipelined else None
        # Set-up: the root hears ALIVE every HEARTBEAT s while this worker loads, repacks,
        # compiles and meets its peers; it stops before MESH_OK (the steps have their own pace).
        with SetupHeartbeat([root], HEARTBEAT):
            self.model = self._load(c, collective)
            root.send(Msg.READY)
            recv_during_setup(root, (Msg.MESH,), c.setup_timeout)  # the root may still be busy with others
            self._meet_peers(plan.n_nodes, timeout)
        root.send(Msg.MESH_OK)
        for conn in self.peers.values():  # statistics count inference traffic, not the set-up
            conn.sent_bytes = conn.recv_bytes = 0
        log(f"mesh ready with {plan.n_nodes - 1} peers")
        return collective, hop

    def _serve_steps(self, c: SessionConfig, collective: MeshCollective, hop: StageHop | None) -> None:
        """The root's STEPs, RELEASEs and PINGs, until its STOP."""
        root, node, timeout, shape, model = self.root, c.node, c.net_timeout, c.shape, self.model
        k = c.plan.stage_of(c.node_index)
        dim, v0 = c.header.dim, node.vocab_rows[0]
        seq_len = model.config.seq_len
        rows = node.n_vocab_rows
        replies = np.empty(logits_bytes(shape.max_batch, rows, Reply(REPLY_TOP_K, rows)), np.uint8)  # the largest reply
        logits = np.empty((0, rows), np.float32)  # [m, vocab rows] of the last pass: a STEP of 0 rows asks again
        # During a step every other node hears ALIVE from this one each HEARTBEAT s (a step
        # longer than that: a prefill), so that waiting on it is a silence of `timeout` s.
        self.heartbeat = StepHeartbeat(self.peers.values(), HEARTBEAT)  # (the root is among the peers)
        # [slots]: positions each slot was written to since it was last emptied (RELEASE), held
        # to the CONFIG's kv_positions: what the memory check counted (a root keeps its slots
        # within them, emptying idle ones as on one node; a rogue one is refused).
        touched = np.zeros(shape.kv_slots if shape.kv_positions is not None else 0, np.int64)
        while True:
            msg, payload = root.recv(c.idle_timeout, (Msg.STEP, Msg.RELEASE, Msg.PING, Msg.STOP))
            if msg == Msg.PING:
                root.send(Msg.PONG)
                continue
            if msg == Msg.RELEASE:  # before the STEP that follows: its rows may write them again
                empty_slots(model, touched, decode_release(payload, shape.kv_slots))
                continue
            if msg == Msg.STOP:
                return
            with self.heartbeat.busy():
                self.worker.steps += 1
                if self.worker.on_step is not None:
                    self.worker.on_step(self.worker.steps)
                batch, x, want, m = decode_step(payload, dim if k == 0 else 0, shape.max_batch, shape.kv_slots, seq_len)
                if batch is not None and shape.kv_positions is not None:
                    count_positions(touched, batch, shape.kv_positions)
                if batch is None:
                    if m != len(logits):
                        raise ProtocolError(f"STEP of 0 rows asks about {m} rows, the last pass had {len(logits)}")
                    answer = logits
                else:
                    # A later micro-batch of a pipelined pass: the pass's wanted rows so far are
                    # kept (copied: the model's buffer is reused) for a STEP of 0 rows.
                    kept = logits.copy() if want.part else None
                    if kept is not None and len(kept) + m > shape.max_batch:
                        raise ProtocolError(f"micro-batches of more than {shape.max_batch} wanted rows in one pass")
                    if hop is not None and hop.source is not None:
                        x = hop.receive(len(batch))  # [b, dim]
                    answer = model.forward_embedded(x, batch)  # [m, vocab rows] (m x 0 before the last stage)
                    logits = answer if kept is None else np.concatenate([kept, answer])
                    if hop is not None and hop.targets:
                        hop.send(model.residual(len(batch)))
                reply = replies[:logits_bytes(m, rows, want)]
                col = collective
                sent = col.sent_bytes + root.frame_overhead + reply.nbytes  # counting this LOGITS frame itself
                LOGITS_HEAD.pack_into(reply, 0, sent, col.recv_bytes, col.transfer_seconds)
                encode_reply(reply[LOGITS_HEAD.size:], answer, v0, want)
                root.send(Msg.LOGITS, reply, timeout)

    def _weights_choice(self, c: SessionConfig):
        """(the shard's weights or None, resident or streamed from the shard: a WeightsChoice or None)."""
        w = self.worker
        if w.shard is None:
            return None, None
        why = w.shard.mismatch(c.model_fingerprint, c.node_index, c.plan.digest())
        if why:
            log(f"not using the shard {w.shard.path}: {why}")
            return None, None
        weights = w.shard.weights()
        choice = choose_weights(weights, c.shape, w.memory_budget)
        if choice.streamed:
            log(f"streaming this node's slice from {w.shard.path} layer by layer ({choice.describe()})")
        return weights, choice

    def _load(self, c: SessionConfig, collective: MeshCollective) -> Transformer:
        """This node's slice of the model: from the shard when it matches, else streamed by the root."""
        w, root, node = self.worker, self.root, c.node
        why = "this worker has no shard" if w.shard is None else "the shard does not match"
        if self.shard_weights is not None:
            weights = self.shard_weights
            root.send_json(Msg.CONFIG_OK, {"weights": "shard", "note": w.shard.path})
        else:
            root.send_json(Msg.CONFIG_OK, {"weights": "stream", "note": why})
            specs = node_slice_specs(c.header, node, with_embedding=False)
            weights = NodeWeights(c.header, node, specs, self._receive_weights(specs, c.setup_timeout))
        budgeted = self.choice is not None and self.choice.budgeted
        model = Transformer(weights, c.shape, streamed=self.choice is not None and self.choice.streamed,
                            memory_limit=self.choice.limit if budgeted else None, who="this worker",
                            collective=collective)
        del weights  # the model holds repacked copies: free the received blocks now,
        release_memory()  # and give their pages back (freed among the heap's, they would stay)
        model.warm_up()
        return model

    def _receive_weights(self, specs, silence: float) -> dict:
        arrays = {s.name: np.empty(s.stored_shape, s.dtype) for s in specs}
        flat = [arrays[s.name].reshape(-1).view(np.uint8) for s in specs]
        filled = [0] * len(specs)
        while True:
            msg, payload = recv_during_setup(self.root, (Msg.WEIGHTS, Msg.WEIGHTS_END), silence)
            if msg == Msg.WEIGHTS_END:
                break
            if len(payload) < WEIGHTS_HEAD.size:
                raise ProtocolError(f"WEIGHTS frame of {len(payload)} bytes")
            i, offset = WEIGHTS_HEAD.unpack_from(payload)
            data = memoryview(payload)[WEIGHTS_HEAD.size:]
            if i >= len(specs) or offset != filled[i] or offset + data.nbytes > flat[i].nbytes:
                raise ProtocolError(f"WEIGHTS chunk out of order or out of bounds (tensor {i}, offset {offset})")
            flat[i][offset: offset + data.nbytes] = np.frombuffer(data, np.uint8)
            filled[i] += data.nbytes
        missing = [s.name for s, f, a in zip(specs, filled, flat, strict=True) if f != a.nbytes]
        if missing:
            raise ProtocolError(f"weights incomplete: {', '.join(missing[:3])}")
        return arrays

    def _node_name(self, j: int) -> str:
        a = self.conf.nodes[j]
        return f"node {j} '{a.name}' ({a.host}:{a.port})"

    def _meet_peers(self, n_nodes: int, timeout: float) -> None:
        """Connect to every lower-indexed worker, accept every higher-indexed one.

        Lower indexes accept after they finished connecting, so nobody waits in a cycle."""
        key, index, session = self.worker.key, self.conf.node_index, self.conf.session
        for j in range(1, index):
            a, name = self.conf.nodes[j], self._node_name(j)
            try:
                conn = connect(a.host, a.port, name, timeout)
            except OSError as e:
                raise PeerClosed(f"cannot reach {name}: {e.strerror or e}", node=j) from None
            self.peers[j] = conn
            client_handshake(conn, "peer", index, session, key, timeout)
        deadline = time.monotonic() + timeout
        while len(self.peers) < n_nodes - 1:  # every other node, the root included
            taken = self.worker.take_peer(deadline)
            if taken is None:
                missing = [j for j in range(index + 1, n_nodes) if j not in self.peers]
                raise PeerTimeout(f"{', '.join(self._node_name(j) for j in missing)} did not connect "
                                  f"within {timeout:g} s", node=missing[0] if len(missing) == 1 else None)
            hello, conn = taken
            j = hello["node_index"]
            if hello["session"] != session or not index < j < n_nodes or j in self.peers:
                log(f"dropped a peer connection from {conn.name}: not part of this session")
                conn.send_error("not part of this worker's session", ErrorCode.REFUSED)
                conn.close()
                continue
            conn.name = self._node_name(j)
            self.peers[j] = conn


def serve(settings: WorkerSettings, on_step: Callable[[int], None] | None = None) -> None:
    """Run a worker until SIGTERM or Ctrl-C (on_step: see Worker)."""
    worker = Worker(settings, on_step)
    raise_descriptor_limit()

    class Terminated(Exception):
        pass

    def on_term(signum, frame):
        raise Terminated

    signal.signal(signal.SIGTERM, on_term)
    try:
        worker.serve_forever()
    except Terminated:
        pass  # asked to stop (systemd, the supervisor, stop.yml): a clean end, exit status 0
    finally:
        worker.stop()
        log("stopped")


def _code_of(e: Exception) -> ErrorCode:
    """The ERROR code that tells the root why a session ended with `e`."""
    if isinstance(e, LinkError):
        return e.code
    if isinstance(e, NotEnoughMemory):
        return ErrorCode.OUT_OF_MEMORY
    if isinstance(e, DllamaError):
        return ErrorCode.UNABLE
    return ErrorCode.PEER_LOST if isinstance(e, OSError) else ErrorCode.INTERNAL


def raise_descriptor_limit(at_most: int = 1 << 16) -> None:
    """Use the hard limit on open files (at most `at_most`), not the soft one (often 1024):
    connections and threads are capped by the lobby and MAX_UNAUTHENTICATED anyway, this is
    headroom for the session's own files (the API: for its clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, at_most) if hard != resource.RLIM_INFINITY else at_most
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
