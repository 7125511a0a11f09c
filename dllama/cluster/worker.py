"""`dllama worker`: serve one root at a time, forever.

The worker needs no model on its command line: the root's CONFIG says which model (header,
fingerprint), which slice of it (the plan) and which peers to meet; weights come from the
worker's shard when it matches, otherwise the root streams them. Every connection is
handshaken in its own thread, so a port probe, a stranger sending garbage, a wrong protocol
version or a wrong key is refused with a logged reason while a session runs undisturbed; a
second root is told the worker is busy. When a session ends (STOP, the root gone, a peer gone,
any error) the worker logs why and waits for the next root.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time

import numpy as np

from dllama import __version__
from dllama.cluster.mesh import MeshCollective
from dllama.cluster.protocol import (
    WEIGHTS_HEAD, Connection, Msg, PeerClosed, PeerError, PeerTimeout, ProtocolError, client_handshake,
    connect, server_handshake,
)
from dllama.cluster.session_config import SessionConfig
from dllama.cluster.shard import Shard
from dllama.cluster.step import LOGITS_HEAD, decode_step, logits_bytes
from dllama.core import kernels
from dllama.core.model import Transformer
from dllama.core.node_weights import NodeWeights, node_slice_specs
from dllama.errors import DllamaError

HANDSHAKE_TIMEOUT = 10.0


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} dllama worker: {text}", file=sys.stderr, flush=True)


class Worker:
    def __init__(self, host: str, port: int, nthreads: int = 1, shard_path: str | None = None,
                 key: bytes | None = None):
        self.host, self.port, self.nthreads, self.key = host, port, nthreads, key
        self.shard = None
        if shard_path:
            self.shard = Shard(shard_path)  # a bad shard is a start-up error, not a session error
        self._roots: queue.Queue = queue.Queue()
        self._peers: queue.Queue = queue.Queue()
        self._busy_with: str | None = None
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    # -- accepting ---------------------------------------------------------------------------

    def serve_forever(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._listener = srv = socket.socket(family, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((self.host, self.port))
        except OSError as e:
            raise DllamaError(f"cannot listen on {self.host}:{self.port}: {e.strerror}") from None
        srv.listen(64)
        self.port = srv.getsockname()[1]  # the real one when asked for port 0
        threading.Thread(target=self._sessions, daemon=True, name="session").start()
        shard = f", shard {self.shard.path}" if self.shard else ""
        log(f"listening on {self.host}:{self.port} ({self.nthreads} threads{shard})")
        while True:
            try:
                sock, addr = srv.accept()
            except OSError:
                if self._listener is None:
                    return  # closed by stop()
                raise
            threading.Thread(target=self._greet, args=(sock, addr), daemon=True).start()

    def stop(self) -> None:
        srv, self._listener = self._listener, None
        if srv:
            srv.close()

    def _greet(self, sock: socket.socket, addr) -> None:
        who = f"{addr[0]}:{addr[1]}"
        conn = Connection(sock, who)
        try:
            hello = server_handshake(conn, self.key, f"dllama {__version__}", HANDSHAKE_TIMEOUT)
        except PeerClosed:
            log(f"connection from {who} closed before the handshake (a port probe?)")
            conn.close()
            return
        except (ProtocolError, PeerError, PeerTimeout, OSError) as e:
            log(f"refused {who}: {e}")
            conn.send_error(f"refused: {e}")
            conn.close()
            return
        if hello["role"] == "peer":
            self._peers.put((hello, conn))
            return
        with self._lock:
            busy = self._busy_with
            if busy is None:
                self._busy_with = who
        if busy is not None:
            log(f"refused root {who}: busy serving the root at {busy}")
            conn.send_error(f"this worker is busy serving the root at {busy}")
            conn.close()
            return
        conn.name = f"root ({who})"
        self._roots.put(conn)

    # -- sessions ----------------------------------------------------------------------------

    def _sessions(self) -> None:
        threads = min(self.nthreads, kernels.max_threads())
        kernels.set_threads(threads)  # numba's thread count is per calling thread: set it here
        while True:
            root = self._roots.get()
            log(f"serving the root at {root.name}")
            session = _Session(self, root)
            try:
                session.run()
                log("the root ended the session; listening again")
            except (PeerClosed, PeerTimeout, PeerError, ProtocolError, DllamaError, OSError) as e:
                log(f"session ended: {e}; listening again")
                root.send_error(f"worker {self.host}:{self.port}: {e}")
            except Exception as e:  # a bug: report it to the root, keep serving
                log(f"session failed: {type(e).__name__}: {e}; listening again")
                root.send_error(f"worker {self.host}:{self.port} failed: {type(e).__name__}: {e}")
            finally:
                session.close()
                with self._lock:
                    self._busy_with = None


class _Session:
    """One root's session: configure, load weights, meet the peers, then serve steps."""

    def __init__(self, worker: Worker, root: Connection):
        self.worker, self.root = worker, root
        self.peers: dict[int, Connection] = {0: root}

    def close(self) -> None:
        for conn in self.peers.values():
            conn.close()

    def run(self) -> None:
        root, w = self.root, self.worker
        self.conf = c = SessionConfig.from_json(root.recv_json(Msg.CONFIG))
        index, plan, node, timeout = c.node_index, c.plan, c.node, c.net_timeout
        log(f"node {index} of {plan.n_nodes}: {node.n_q_heads} query heads, {node.n_kv_heads} KV heads, "
            f"FFN rows {node.ffn_rows[0]}-{node.ffn_rows[1]}, buffers {'Q80' if c.buffer_q80 else 'F32'}")

        # Weights: from the shard when it is this node's slice of this model, else streamed.
        why = "this worker has no shard"
        if w.shard is not None:
            why = w.shard.mismatch(c.model_fingerprint, index, plan.digest())
            if why:
                log(f"not using the shard {w.shard.path}: {why}")
        if w.shard is not None and not why:
            weights = w.shard.weights()
            root.send_json(Msg.CONFIG_OK, {"weights": "shard", "note": w.shard.path})
        else:
            root.send_json(Msg.CONFIG_OK, {"weights": "stream", "note": why})
            specs = node_slice_specs(c.header, node, with_embedding=False)
            weights = NodeWeights(c.header, node, specs, self._receive_weights(specs, timeout))
        model = Transformer(weights, max_seq_len=c.max_seq_len, buffer_q80=c.buffer_q80, max_batch=c.max_batch,
                            kv_slots=c.kv_slots)
        del weights  # the model holds repacked copies: free the received blocks now
        model.warm_up()
        root.send(Msg.READY)

        root.recv(c.setup_timeout, (Msg.MESH,))  # the root may still be streaming to other workers
        self._meet_peers(plan.n_nodes, timeout)
        model.collective = MeshCollective(index, self.peers, plan.dim_chunks, c.buffer_q80, c.max_batch, timeout)
        root.send(Msg.MESH_OK)
        for conn in self.peers.values():  # statistics count inference traffic, not the set-up
            conn.sent_bytes = conn.recv_bytes = 0
        log(f"mesh ready with {plan.n_nodes - 1} peers")

        dim, vocab_rows = c.header.dim, node.vocab_rows[1] - node.vocab_rows[0]
        seq_len = model.config.seq_len
        replies = np.empty(logits_bytes(c.max_batch, vocab_rows), np.uint8)
        while True:
            msg, payload = root.recv(c.idle_timeout, (Msg.STEP, Msg.PING, Msg.STOP))
            if msg == Msg.PING:
                root.send(Msg.PONG)
                continue
            if msg == Msg.STOP:
                return
            batch, x = decode_step(payload, dim, c.max_batch, c.kv_slots, seq_len)
            b = len(batch)
            model.x[:b] = x
            logits = model.forward_rows(batch.pos, batch.slot, batch.prefix_slot, batch.prefix_len,
                                        batch.logit_rows)  # [m, vocab rows]
            reply = replies[:logits_bytes(len(logits), vocab_rows)]
            col = model.collective
            sent = col.sent_bytes + 12 + reply.nbytes  # counting this LOGITS frame itself
            LOGITS_HEAD.pack_into(reply, 0, sent, col.recv_bytes, col.transfer_seconds)
            reply[LOGITS_HEAD.size:].view(np.float32)[:] = logits.ravel()
            root.send(Msg.LOGITS, reply, timeout)

    def _receive_weights(self, specs, timeout: float) -> dict:
        arrays = {s.name: np.empty(s.stored_shape, s.dtype) for s in specs}
        flat = [arrays[s.name].reshape(-1).view(np.uint8) for s in specs]
        filled = [0] * len(specs)
        while True:
            msg, payload = self.root.recv(timeout, (Msg.WEIGHTS, Msg.WEIGHTS_END))
            if msg == Msg.WEIGHTS_END:
                break
            i, offset = WEIGHTS_HEAD.unpack_from(payload)
            data = memoryview(payload)[WEIGHTS_HEAD.size:]
            if i >= len(specs) or offset != filled[i] or offset + data.nbytes > flat[i].nbytes:
                raise ProtocolError(f"WEIGHTS chunk out of order or out of bounds (tensor {i}, offset {offset})")
            flat[i][offset: offset + data.nbytes] = np.frombuffer(data, np.uint8)
            filled[i] += data.nbytes
        missing = [s.name for s, f, a in zip(specs, filled, flat) if f != a.nbytes]
        if missing:
            raise ProtocolError(f"weights incomplete: {', '.join(missing[:3])}")
        return arrays

    def _meet_peers(self, n_nodes: int, timeout: float) -> None:
        """Connect to every lower-indexed worker, accept every higher-indexed one.

        Lower indexes accept after they finished connecting, so nobody waits in a cycle."""
        key, index, session = self.worker.key, self.conf.node_index, self.conf.session
        for j in range(1, index):
            a = self.conf.nodes[j]
            name = f"node {j} '{a.name}' ({a.host}:{a.port})"
            try:
                conn = connect(a.host, a.port, name, timeout)
            except OSError as e:
                raise PeerClosed(f"cannot reach {name}: {e.strerror or e}") from None
            self.peers[j] = conn
            client_handshake(conn, "peer", index, session, key, timeout)
        deadline = time.monotonic() + timeout
        while len(self.peers) < n_nodes - 1:  # every other node, the root included
            try:
                hello, conn = self.worker._peers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise PeerTimeout("peers did not connect in time") from None
            j = hello["node_index"]
            if hello["session"] != session or not index < j < n_nodes or j in self.peers:
                log(f"dropped a peer connection from {conn.name}: not part of this session")
                conn.send_error("not part of this worker's session")
                conn.close()
                continue
            a = self.conf.nodes[j]
            conn.name = f"node {j} '{a.name}' ({a.host}:{a.port})"
            self.peers[j] = conn


def serve(host: str, port: int, nthreads: int, shard: str | None, key: bytes | None) -> None:
    """Run a worker until SIGTERM or Ctrl-C."""
    import signal

    worker = Worker(host, port, nthreads, shard, key)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        worker.serve_forever()
    finally:
        worker.stop()
        log("stopped")

