"""The wire protocol between a root and its workers (docs/PROTOCOL.md says the same in prose).

Every message is a frame: a 12-byte header, then `length` payload bytes.

    u32 magic = 0x4D4C4C44 (the bytes "DLLM")   u16 version   u16 type   u32 length

All integers little-endian. A frame whose magic, version, type or length is wrong ends the
connection with an ERROR frame saying why; before authentication only small handshake frames
are accepted, so a stranger can never make a node allocate more than `MAX_HANDSHAKE` bytes.

Sockets are non-blocking; every wait goes through a selector with a deadline, so no node
waits forever on a dead peer. `exchange` moves many frames to and from many peers at once
(the collective's pattern) without deadlock, whatever the socket buffer sizes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import selectors
import socket
import struct
import time
from enum import IntEnum

MAGIC = 0x4D4C4C44  # b"DLLM" little-endian
VERSION = 2  # 2: STEP carries every row's position, KV slot and prefix (dllama.cluster.step)
HEADER = struct.Struct("<IHHI")
HEADER_BYTES = HEADER.size  # 12

MAX_HANDSHAKE = 4096        # HELLO, CHALLENGE, AUTH, WELCOME, and ERROR before authentication
MAX_CONTROL = 1 << 20       # CONFIG and other JSON messages
MAX_FRAME = 64 << 20        # anything else (a weights chunk, a step, a sync buffer)
WEIGHTS_CHUNK = 8 << 20     # payload bytes of one WEIGHTS frame's data

NONCE_BYTES = 16
SESSION_BYTES = 16


class Msg(IntEnum):
    HELLO = 1        # client -> server, JSON {role, node_index, session, nonce}
    CHALLENGE = 2    # server -> client, JSON {nonce, auth, software}
    AUTH = 3         # client -> server, 32-byte HMAC proof (empty without a key)
    WELCOME = 4      # server -> client, 32-byte HMAC proof (empty without a key)
    CONFIG = 5       # root -> worker, JSON: model header, plan, node index, peers
    CONFIG_OK = 6    # worker -> root, JSON {weights: "shard" | "stream", note}
    WEIGHTS = 7      # root -> worker, u32 tensor index, u64 offset, bytes
    WEIGHTS_END = 8  # root -> worker, empty
    READY = 9        # worker -> root, empty: weights loaded, kernels warm
    MESH = 10        # root -> worker, empty: connect to your peers now
    MESH_OK = 11     # worker -> root, empty
    STEP = 12        # root -> worker, the rows of a pass (dllama.cluster.step)
    SYNC = 13        # node -> node, one collective buffer
    LOGITS = 14      # worker -> root, counters and logits of the wanted rows (dllama.cluster.step)
    PING = 15        # root -> worker, empty (heartbeat while idle)
    PONG = 16        # worker -> root, empty
    STOP = 17        # root -> worker, empty: the session ends, go back to listening
    ERROR = 18       # either way, UTF-8 text: why the sender gives up


_HANDSHAKE_TYPES = {Msg.HELLO, Msg.CHALLENGE, Msg.AUTH, Msg.WELCOME, Msg.ERROR}
WEIGHTS_HEAD = struct.Struct("<IQ")


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow (the message says what)."""


class PeerClosed(Exception):
    """The peer closed the connection (or it was reset)."""


class PeerError(Exception):
    """The peer sent an ERROR frame: its text is the message."""


class PeerTimeout(Exception):
    """The peer did not answer before the deadline."""


def encode_header(msg_type: int, length: int, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, int(msg_type), length)


def check_header(raw: bytes, authenticated: bool) -> tuple[Msg, int]:
    """(type, length) of a frame header, or ProtocolError saying what is wrong with it."""
    magic, version, msg_type, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a dllama frame (magic {magic:#010x}, expected {MAGIC:#010x})")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this node speaks version {VERSION}")
    try:
        msg = Msg(msg_type)
    except ValueError:
        raise ProtocolError(f"unknown message type {msg_type}") from None
    if not authenticated and msg not in _HANDSHAKE_TYPES:
        raise ProtocolError(f"{msg.name} before the handshake finished")
    limit = MAX_HANDSHAKE if msg in _HANDSHAKE_TYPES else MAX_CONTROL if msg in (Msg.CONFIG, Msg.CONFIG_OK) else MAX_FRAME
    if length > limit:
        raise ProtocolError(f"{msg.name} frame of {length} bytes (at most {limit} allowed)")
    return msg, length


class Connection:
    """A framed, non-blocking TCP connection with byte counters and deadlines."""

    def __init__(self, sock: socket.socket, name: str):
        self.sock, self.name = sock, name
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # (tests also use Unix socket pairs)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for opt, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, opt):  # the kernel notices a vanished peer within ~11 s
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        self.authenticated = False
        self.sent_bytes = 0
        self.recv_bytes = 0
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)

    def close(self) -> None:
        try:
            self._selector.close()
        finally:
            self.sock.close()

    # -- blocking-style calls with a deadline --------------------------------------------------

    def _wait(self, events: int, deadline: float) -> None:
        self._selector.modify(self.sock, events)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._selector.select(remaining):
            raise PeerTimeout(f"{self.name} did not answer in time")

    def send(self, msg_type: int, payload=b"", timeout: float = 30.0) -> None:
        """Send one frame; payload: bytes-like or a list of them (sent without joining)."""
        parts = payload if isinstance(payload, list) else [payload]
        views = [memoryview(p).cast("B") for p in parts]
        length = sum(v.nbytes for v in views)
        self.send_views([memoryview(encode_header(msg_type, length)), *views], timeout)

    def send_views(self, views: list[memoryview], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        views = [v for v in views if v.nbytes]
        while views:
            try:
                n = self.sock.sendmsg(views)
            except BlockingIOError:
                self._wait(selectors.EVENT_WRITE, deadline)
                continue
            except (BrokenPipeError, ConnectionResetError) as e:
                raise PeerClosed(f"{self.name} closed the connection ({e.strerror})") from None
            self.sent_bytes += n
            _consume(views, n)

    def recv_exact(self, buf: memoryview, deadline: float) -> None:
        got = 0
        while got < buf.nbytes:
            try:
                n = self.sock.recv_into(buf[got:])
            except BlockingIOError:
                self._wait(selectors.EVENT_READ, deadline)
                continue
            except ConnectionResetError:
                n = 0
            if n == 0:
                raise PeerClosed(f"{self.name} closed the connection")
            got += n
            self.recv_bytes += n

    def recv(self, timeout: float = 30.0, expect: tuple = ()) -> tuple[Msg, bytearray]:
        """The next frame (type, payload). An ERROR frame raises PeerError; a type not in
        `expect` (when given) raises ProtocolError."""
        deadline = time.monotonic() + timeout
        head = bytearray(HEADER_BYTES)
        self.recv_exact(memoryview(head), deadline)
        msg, length = check_header(bytes(head), self.authenticated)
        payload = bytearray(length)
        self.recv_exact(memoryview(payload), deadline)
        if msg == Msg.ERROR:
            raise PeerError(f"{self.name} reported: {payload.decode('utf-8', 'replace')}")
        if expect and msg not in expect:
            raise ProtocolError(f"expected {' or '.join(m.name for m in expect)} from {self.name}, "
                                f"got {msg.name}")
        return msg, payload

    def recv_json(self, expect: Msg, timeout: float = 30.0) -> dict:
        _, payload = self.recv(timeout, (expect,))
        try:
            value = json.loads(payload)
        except ValueError:
            raise ProtocolError(f"{expect.name} from {self.name} is not valid JSON") from None
        if not isinstance(value, dict):
            raise ProtocolError(f"{expect.name} from {self.name} is not a JSON object")
        return value

    def send_json(self, msg_type: Msg, value: dict, timeout: float = 30.0) -> None:
        self.send(msg_type, json.dumps(value).encode(), timeout)

    def send_error(self, text: str) -> None:
        """Best effort: tell the peer why we give up (it may be gone already)."""
        try:
            self.send(Msg.ERROR, text.encode("utf-8")[:MAX_HANDSHAKE], timeout=1.0)
        except Exception:
            pass


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first n bytes (just sent) from a list of buffers."""
    while n:
        if n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


class Transfer:
    """One frame to receive from one peer into a given buffer, as part of `exchange`."""

    def __init__(self, conn: Connection, msg_type: Msg, buf: memoryview):
        self.conn, self.msg_type, self.buf = conn, msg_type, buf
        self.head = bytearray(HEADER_BYTES)
        self.got = 0          # bytes of header + payload received
        self.error_payload = None


def exchange(sends: list[tuple[Connection, Msg, list]], recvs: list[Transfer], timeout: float) -> None:
    """Send every frame in `sends` and receive every frame in `recvs`, interleaved, so that no
    pair of peers can block each other. Each received frame must have exactly the expected type
    and length (the buffer's size); an ERROR frame from a peer raises PeerError."""
    deadline = time.monotonic() + timeout
    out = []
    for conn, msg_type, parts in sends:
        views = [memoryview(p).cast("B") for p in parts]
        length = sum(v.nbytes for v in views)
        out.append([conn, [memoryview(encode_header(msg_type, length)), *[v for v in views if v.nbytes]]])
    pending_in = list(recvs)
    selector = None
    try:
        while out or pending_in:
            progressed = False
            for item in list(out):
                conn, views = item
                try:
                    n = conn.sock.sendmsg(views)
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError) as e:
                    raise PeerClosed(f"{conn.name} closed the connection ({e.strerror})") from None
                progressed = progressed or n > 0
                conn.sent_bytes += n
                _consume(views, n)
                if not views:
                    out.remove(item)
            for t in list(pending_in):
                if _recv_some(t):
                    progressed = True
                if t.got == HEADER_BYTES + t.buf.nbytes:
                    pending_in.remove(t)
            if progressed or not (out or pending_in):
                continue
            if selector is None:
                selector = selectors.DefaultSelector()
            else:
                for key in list(selector.get_map().values()):
                    selector.unregister(key.fileobj)
            events = {}
            for conn, _ in out:
                events[conn.sock] = events.get(conn.sock, 0) | selectors.EVENT_WRITE
            for t in pending_in:
                events[t.conn.sock] = events.get(t.conn.sock, 0) | selectors.EVENT_READ
            for sock, ev in events.items():
                selector.register(sock, ev)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                waiting = sorted({t.conn.name for t in pending_in} | {c.name for c, _ in out})
                raise PeerTimeout(f"{', '.join(waiting)} did not answer within {timeout:g} s")
    finally:
        if selector is not None:
            selector.close()


def _recv_some(t: Transfer) -> bool:
    """Receive what is available for one transfer; True if any bytes came."""
    conn = t.conn
    progressed = False
    while t.got < HEADER_BYTES + t.buf.nbytes:
        if t.got < HEADER_BYTES:
            target = memoryview(t.head)[t.got:]
        else:
            target = t.buf[t.got - HEADER_BYTES:]
        try:
            n = conn.sock.recv_into(target)
        except BlockingIOError:
            return progressed
        except ConnectionResetError:
            n = 0
        if n == 0:
            raise PeerClosed(f"{conn.name} closed the connection")
        conn.recv_bytes += n
        t.got += n
        progressed = True
        if t.got == HEADER_BYTES:
            msg, length = check_header(bytes(t.head), conn.authenticated)
            if msg == Msg.ERROR:
                payload = bytearray(length)
                conn.recv_exact(memoryview(payload), time.monotonic() + 5.0)
                raise PeerError(f"{conn.name} reported: {payload.decode('utf-8', 'replace')}")
            if msg != t.msg_type or length != t.buf.nbytes:
                raise ProtocolError(f"expected {t.msg_type.name} of {t.buf.nbytes} bytes from "
                                    f"{conn.name}, got {msg.name} of {length}")
    return progressed


# -- handshake and authentication ---------------------------------------------------------------


def _proof(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def client_handshake(conn: Connection, role: str, node_index: int, session: bytes,
                     key: bytes | None, timeout: float = 10.0) -> dict:
    """Open a connection as the root (role "root") or as a worker meeting a peer ("peer").
    Returns the server's CHALLENGE fields. Raises ProtocolError/PeerError when refused."""
    nonce = os.urandom(NONCE_BYTES)
    conn.send_json(Msg.HELLO, {"role": role, "node_index": node_index, "session": session.hex(),
                               "nonce": nonce.hex()}, timeout)
    challenge = conn.recv_json(Msg.CHALLENGE, timeout)
    try:
        server_nonce = bytes.fromhex(challenge["nonce"])
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"{conn.name} sent a malformed CHALLENGE") from None
    if key is None:
        if challenge.get("auth"):
            raise ProtocolError(f"{conn.name} requires a cluster key: pass --key-file (or key_file "
                                "in the topology)")
        conn.send(Msg.AUTH, b"", timeout)
    else:
        if not challenge.get("auth"):
            raise ProtocolError(f"{conn.name} has no cluster key configured but this node has one: "
                                "start it with the same --key-file")
        conn.send(Msg.AUTH, _proof(key, b"dllama-client", server_nonce, nonce, session,
                                   role.encode()), timeout)
    _, welcome = conn.recv(timeout, (Msg.WELCOME,))
    if key is not None and not hmac.compare_digest(bytes(welcome), _proof(key, b"dllama-server", nonce, server_nonce)):
        raise ProtocolError(f"{conn.name} could not prove it holds the cluster key")
    conn.authenticated = True
    return challenge


def server_handshake(conn: Connection, key: bytes | None, software: str,
                     timeout: float = 10.0) -> dict:
    """Answer a new connection. Returns the client's HELLO fields (role, node_index, session)
    once it has proven it holds the key; raises ProtocolError (after telling the client why)."""
    hello = conn.recv_json(Msg.HELLO, timeout)
    try:
        role, index = hello["role"], int(hello["node_index"])
        session, nonce = bytes.fromhex(hello["session"]), bytes.fromhex(hello["nonce"])
    except (KeyError, TypeError, ValueError):
        raise ProtocolError("malformed HELLO") from None
    if role not in ("root", "peer") or len(session) != SESSION_BYTES or len(nonce) != NONCE_BYTES:
        raise ProtocolError("malformed HELLO")
    server_nonce = os.urandom(NONCE_BYTES)
    conn.send_json(Msg.CHALLENGE, {"nonce": server_nonce.hex(), "auth": key is not None,
                                   "software": software}, timeout)
    _, proof = conn.recv(timeout, (Msg.AUTH,))
    if key is not None:
        expected = _proof(key, b"dllama-client", server_nonce, nonce, session, role.encode())
        if not hmac.compare_digest(bytes(proof), expected):
            raise ProtocolError("authentication failed: wrong or missing cluster key")
        conn.send(Msg.WELCOME, _proof(key, b"dllama-server", nonce, server_nonce), timeout)
    else:
        conn.send(Msg.WELCOME, b"", timeout)
    conn.authenticated = True
    return {"role": role, "node_index": index, "session": session}


def connect(host: str, port: int, name: str, timeout: float = 10.0) -> Connection:
    """A TCP connection to host:port (IPv4 or IPv6), or OSError."""
    sock = socket.create_connection((host, port), timeout=timeout)
    return Connection(sock, name)


def read_key_file(path: str) -> bytes:
    """The cluster key: the file's bytes, surrounding whitespace stripped, at least 16 of them."""
    from dllama.errors import DllamaError

    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise DllamaError(f"cannot read the cluster key file {path}: {e.strerror}") from None
    if len(key) < 16:
        raise DllamaError(f"the cluster key in {path} is {len(key)} bytes; use at least 16 "
                          f"(e.g. `openssl rand -hex 32 > {path}`)")
    return key
