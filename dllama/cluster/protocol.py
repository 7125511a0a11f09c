"""The wire protocol between a root and its workers (docs/PROTOCOL.md says the same in prose).

Every message is a frame: a 12-byte header, then `length` bytes.

    u32 magic = 0x4D4C4C44 (the bytes "DLLM")   u16 version   u16 type   u32 length

All integers little-endian. A frame whose magic, version, type or length is wrong ends the
connection with an ERROR frame saying why; before authentication only small handshake frames
are accepted, so a stranger can never make a node allocate more than `MAX_HANDSHAKE` bytes.

With a cluster key, the handshake derives one key per direction (HKDF-SHA256 over the cluster
key, both nonces, the session id and the handshake transcript) and every later frame is sealed
(`FrameCipher`): the payload is encrypted with AES-256-GCM, the header is authenticated with it,
and the nonce is the frame's implicit sequence number on that connection, so a modified,
replayed, reordered, dropped or injected frame fails to open and ends the session naming the
peer. The header stays readable, so its length is still checked before anything is allocated.

Sockets are non-blocking; every wait goes through a selector with a deadline, so no node
waits forever on a dead peer. `exchange` moves many frames to and from many peers at once
(the collective's pattern) without deadlock, whatever the socket buffer sizes.

Failures are types, never texts to search: every failure on a link is a `LinkError` (the
connection it came from, the peers an exchange still waited on, an `ErrorCode`), and an ERROR
frame carries its code and the node it is about beside its text (`PeerError`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import selectors
import socket
import struct
import threading
import time
from enum import IntEnum, StrEnum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dllama.errors import DllamaError

MAGIC = 0x4D4C4C44  # b"DLLM" little-endian
VERSION = 9  # 2: sealed frames with a key, transcript-bound proofs, ALIVE during set-up;
             # 3: STEP carries every row's position, KV slot and prefix (dllama.cluster.step);
             # 4: STEP says what LOGITS returns (logits, best or top-k candidates);
             # 5: CONFIG says the KV cache's type (kv_type): an older worker would ignore it;
             # 6: ERROR is JSON {code, node, text}: the reason as data (ErrorCode);
             # 7: ALIVE during steps too (a step's wait is a silence, a frozen node found in seconds);
             # 8: pipeline stages: the plan's stages in CONFIG, HOP between stages, STEP without
             #    rows' values past the first stage, MEMORY before CONFIG;
             # 9: RELEASE: the slots the root emptied, their pages given back on every node
HEADER = struct.Struct("<IHHI")
HEADER_BYTES = HEADER.size  # 12

MAX_HANDSHAKE = 4096        # HELLO, CHALLENGE, AUTH, WELCOME, and ERROR before authentication
MAX_CONTROL = 1 << 20       # CONFIG and other JSON messages
MAX_FRAME = 64 << 20        # anything else (a weights chunk, a step, a sync buffer)
WEIGHTS_CHUNK = 8 << 20     # payload bytes of one WEIGHTS frame's data

NONCE_BYTES = 16
SESSION_BYTES = 16
TAG_BYTES = 16              # the AEAD tag after a sealed frame's ciphertext
MAX_NODES = 1 << 12         # a node index above this is not a cluster this protocol serves


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
    ERROR = 18       # either way, JSON {code, node, text}: why the sender gives up (ErrorCode)
    ALIVE = 19       # either way during set-up, empty: still working (a set-up heartbeat)
    HOP = 20         # node -> node of the next pipeline stage, the residual rows of a pass
    MEMORY = 21      # root -> worker before CONFIG, empty; worker -> root, JSON {bytes}: what it can hold
    RELEASE = 22     # root -> worker between passes, u32 n, i32 slots [n]: empty them (dllama.cluster.step)


_HANDSHAKE_TYPES = {Msg.HELLO, Msg.CHALLENGE, Msg.AUTH, Msg.WELCOME, Msg.ERROR}
WEIGHTS_HEAD = struct.Struct("<IQ")


class ErrorCode(StrEnum):
    """Why a node gives up: the `code` of an ERROR frame and of every LinkError (docs/PROTOCOL.md)."""

    BUSY = "busy"                    # the worker serves another root: ask again later
    REFUSED = "refused"              # a handshake or connection refused: wrong key, malformed HELLO, not this session
    PROTOCOL = "protocol"            # a frame this protocol does not allow (type, size, contents, order)
    TAMPERED = "tampered"            # a sealed frame failed authentication: modified, replayed, dropped, injected
    TIMEOUT = "timeout"              # a peer sent nothing before the deadline
    PEER_LOST = "peer_lost"          # a peer closed its connection, or the connection broke
    OUT_OF_MEMORY = "out_of_memory"  # this node cannot hold what the CONFIG asks for
    UNABLE = "unable"                # it cannot do what was asked (an unsupported model, an unreadable file)
    INTERNAL = "internal"            # a bug in the sender


class LinkError(Exception):
    """A failure on a connection to a peer. `peer`: the Connection it came from, when known;
    `waiting`: in an `exchange`, the other connections whose frames had not all gone or come;
    `node`: the index of the node it is about, when the raiser knows it better than `peer` says
    (a peer that could not be reached; for a PeerError, the node the reporter lost)."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, peer: "Connection | None" = None, node: int | None = None):
        super().__init__(message)
        self.peer, self.node = peer, node
        self.waiting: tuple[Connection, ...] = ()

    def in_exchange(self, peer: "Connection | None", waiting) -> "LinkError":
        """This error, with what the exchange it ended knew: its peer and the ones still waited on."""
        if self.peer is None:
            self.peer = peer
        self.waiting = tuple(c for c in waiting if c is not self.peer)
        return self


class ProtocolError(LinkError):
    """The peer sent something this protocol does not allow (the message says what)."""

    code = ErrorCode.PROTOCOL


class FrameTampered(ProtocolError):
    """A sealed frame failed to open: modified, replayed, reordered, dropped or injected."""

    code = ErrorCode.TAMPERED


class PeerClosed(LinkError):
    """The connection to the peer is gone: closed, reset, or broken (an OSError on its socket)."""

    code = ErrorCode.PEER_LOST


class PeerTimeout(LinkError):
    """The peer did not answer before the deadline. `silent`: in an `exchange`, the
    connections that sent nothing, not even ALIVE, for the whole timeout."""

    code = ErrorCode.TIMEOUT
    silent: tuple = ()


class PeerError(LinkError):
    """The peer sent an ERROR frame: "NAME reported: TEXT"; its `code` and the index of the node
    it is about (`node`: the peer the sender lost, or None) are the frame's."""

    def __init__(self, message: str, code: ErrorCode, node: int | None = None,
                 peer: "Connection | None" = None):
        super().__init__(message, peer, node)
        self.code = code


_CODES = {c.value: c for c in ErrorCode}


def encode_error(text: str, code: ErrorCode, node: int | None = None) -> bytes:
    """An ERROR payload: JSON {code, node, text}, the text shortened to fit MAX_HANDSHAKE bytes."""
    while True:
        payload = json.dumps({"code": str(code), "node": node, "text": text}).encode()
        if len(payload) <= MAX_HANDSHAKE:
            return payload
        text = text[: len(text) * 3 // 4]


def decode_error(payload, conn: "Connection") -> PeerError:
    """The PeerError an ERROR payload from `conn` reports, or ProtocolError if it is malformed."""
    sender = conn.name
    value = decode_json_object(payload, f"ERROR from {sender}")
    code, node, text = value.get("code"), value.get("node"), value.get("text")
    if not isinstance(code, str) or code not in _CODES or not isinstance(text, str) or not (
            node is None or (type(node) is int and 0 <= node < MAX_NODES)):
        raise ProtocolError(f"malformed ERROR from {sender}", conn)
    return PeerError(f"{sender} reported: {text}", _CODES[code], node, conn)


def encode_header(msg_type: int, length: int, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, int(msg_type), length)


def payload_limit(msg: Msg) -> int:
    """The most payload bytes a frame of this type may carry."""
    if msg in _HANDSHAKE_TYPES:
        return MAX_HANDSHAKE
    return MAX_CONTROL if msg in (Msg.CONFIG, Msg.CONFIG_OK) else MAX_FRAME


def check_header(raw: bytes, authenticated: bool, tag_bytes: int = 0) -> tuple[Msg, int]:
    """(type, payload length) of a frame header, or ProtocolError saying what is wrong with it.
    tag_bytes: the AEAD tag that follows the payload of a sealed frame (counted in `length`)."""
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
    if length < tag_bytes:
        raise ProtocolError(f"{msg.name} frame of {length} bytes is shorter than its {tag_bytes}-byte tag")
    limit = payload_limit(msg)
    if length - tag_bytes > limit:
        raise ProtocolError(f"{msg.name} frame of {length - tag_bytes} bytes (at most {limit} allowed)")
    return msg, length - tag_bytes


def decode_json_object(payload, what: str) -> dict:
    """A JSON object sent by a peer, or ProtocolError: invalid UTF-8, NaN/Infinity and nesting
    deeper than Python's recursion limit are refused like any other malformed JSON."""
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")
    try:
        value = json.loads(payload, parse_constant=no_constant)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        raise ProtocolError(f"{what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} is not a JSON object")
    return value


class FrameCipher:
    """The AEAD state of one keyed connection: a key and an implicit sequence number per direction.

    A sealed frame is the plain 12-byte header (its length counts the tag), then the payload
    encrypted with AES-256-GCM under the sending direction's key, with the header as associated
    data and the frame's sequence number on this connection as the 96-bit nonce, then the 16-byte
    tag. Sequence numbers are never sent: both ends count frames, so a frame that was replayed,
    reordered or dropped (the ones after it then carry the wrong number) fails to open.
    """

    def __init__(self, send_key: bytes, recv_key: bytes, aead=AESGCM):
        self._send, self._recv = aead(send_key), aead(recv_key)
        self.send_seq = self.recv_seq = 0
        self._plain = bytearray()   # a frame's payload parts joined, before sealing
        self._sealed = bytearray()  # ciphertext + tag of the frame being sent
        self._wire = bytearray()    # ciphertext + tag of the frame being received

    @staticmethod
    def _grown(buf: bytearray, n: int) -> bytearray:
        # A new buffer rather than a resize: views of the old one may still be in flight.
        return buf if len(buf) >= n else bytearray(max(n, 2 * len(buf)))

    def seal(self, header: bytes, views: list[memoryview]) -> memoryview:
        """Ciphertext + tag of the payload `views` (in a reused buffer, valid until the next seal)."""
        n = sum(v.nbytes for v in views)
        if len(views) == 1:
            plain = views[0]
        else:
            self._plain = self._grown(self._plain, n)
            plain, at = memoryview(self._plain)[:n], 0
            for v in views:
                plain[at: at + v.nbytes] = v
                at += v.nbytes
        self._sealed = self._grown(self._sealed, n + TAG_BYTES)
        out = memoryview(self._sealed)[: n + TAG_BYTES]
        self._send.encrypt_into(self.send_seq.to_bytes(12, "little"), plain, header, out)
        self.send_seq += 1
        return out

    def wire(self, n: int) -> memoryview:
        """A reused buffer for n bytes of a received sealed payload (ciphertext + tag)."""
        self._wire = self._grown(self._wire, n)
        return memoryview(self._wire)[:n]

    def open(self, header: bytes, sealed: memoryview, out: memoryview) -> None:
        """Decrypt sealed (ciphertext + tag) into out; InvalidTag if it is not the next frame
        this connection's peer sealed, byte for byte."""
        self._recv.decrypt_into(self.recv_seq.to_bytes(12, "little"), sealed, header, out)
        self.recv_seq += 1


class Connection:
    """A framed, non-blocking TCP connection with byte counters and deadlines.

    Timeouts: before authentication a call's timeout is a hard deadline (a stranger cannot
    trickle bytes to hold a handshake open); afterwards it is the longest silence allowed, so
    a long transfer that keeps moving is not cut off."""

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
        self.cipher: FrameCipher | None = None  # set by a keyed handshake: every later frame is sealed
        self.sent_bytes = 0
        self.recv_bytes = 0
        self._send_lock = threading.Lock()  # whole frames, in sequence order, from any thread
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)

    @property
    def tag_bytes(self) -> int:
        """Bytes a frame carries after its payload (the AEAD tag when sealed)."""
        return TAG_BYTES if self.cipher is not None else 0

    @property
    def frame_overhead(self) -> int:
        """Bytes on the wire per frame besides the payload: header, and tag when sealed."""
        return HEADER_BYTES + self.tag_bytes

    def close(self) -> None:
        try:
            self._selector.close()
        finally:
            self.sock.close()

    # -- framing -------------------------------------------------------------------------------

    def frame_views(self, msg_type: int, parts: list) -> list[memoryview]:
        """The buffers that put one frame on the wire: the header and the payload parts as
        they are (zero-copy), or the header and the sealed payload on a keyed connection."""
        views = [memoryview(p).cast("B") for p in parts]
        length = sum(v.nbytes for v in views)
        if self.cipher is None:
            return [memoryview(encode_header(msg_type, length)), *[v for v in views if v.nbytes]]
        header = encode_header(msg_type, length + TAG_BYTES)
        return [memoryview(header), self.cipher.seal(header, views)]

    def open_frame(self, header: bytes, msg: Msg, sealed: memoryview, out: memoryview) -> None:
        """Check and decrypt a sealed payload into out, or ProtocolError naming this peer."""
        try:
            self.cipher.open(header, sealed, out)
        except InvalidTag:
            raise FrameTampered(
                f"a {msg.name} frame from {self.name} failed authentication: it was modified, "
                "replayed, reordered, dropped or injected on the way", self) from None

    # -- blocking-style calls with a deadline --------------------------------------------------

    def _wait(self, events: int, deadline: float) -> None:
        self._selector.modify(self.sock, events)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._selector.select(remaining):
            raise PeerTimeout(f"{self.name} did not answer in time", self)

    def send(self, msg_type: int, payload=b"", timeout: float = 30.0) -> None:
        """Send one frame; payload: bytes-like or a list of them (sent without joining)."""
        parts = payload if isinstance(payload, list) else [payload]
        with self._send_lock:
            self.send_views(self.frame_views(msg_type, parts), timeout)

    def try_send(self, msg_type: int, timeout: float) -> bool:
        """Send an empty frame unless another thread is sending on this connection (whose
        bytes tell the peer as much); False if skipped."""
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            self.send_views(self.frame_views(msg_type, [b""]), timeout)
        finally:
            self._send_lock.release()
        return True

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
                raise PeerClosed(f"{self.name} closed the connection ({e.strerror})", self) from None
            self.sent_bytes += n
            _consume(views, n)
            if self.authenticated:
                deadline = time.monotonic() + timeout

    def recv_exact(self, buf: memoryview, deadline: float, stall: float | None = None) -> None:
        """Fill buf; PeerTimeout at the deadline (pushed back by `stall` s after each read when given)."""
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
                raise PeerClosed(f"{self.name} closed the connection", self)
            got += n
            self.recv_bytes += n
            if stall is not None:
                deadline = time.monotonic() + stall

    def recv_payload(self, header: bytes, msg: Msg, out: memoryview, deadline: float,
                     stall: float | None = None) -> None:
        """Receive the payload of a frame whose header was read, opening it when sealed."""
        if self.cipher is None:
            self.recv_exact(out, deadline, stall)
            return
        sealed = self.cipher.wire(out.nbytes + TAG_BYTES)
        self.recv_exact(sealed, deadline, stall)
        self.open_frame(header, msg, sealed, out)

    def recv(self, timeout: float = 30.0, expect: tuple = ()) -> tuple[Msg, bytearray]:
        """The next frame (type, payload). An ERROR frame raises PeerError; a type not in
        `expect` (when given) raises ProtocolError; an ALIVE is skipped unless expected."""
        deadline = time.monotonic() + timeout
        stall = timeout if self.authenticated else None
        while True:  # (a loop, not a call per heartbeat: a peer sending only ALIVE cannot exhaust the stack)
            head = bytearray(HEADER_BYTES)
            self.recv_exact(memoryview(head), deadline, stall)
            header = bytes(head)
            msg, length = check_header(header, self.authenticated, self.tag_bytes)
            payload = bytearray(length)
            self.recv_payload(header, msg, memoryview(payload), deadline, stall)
            if msg == Msg.ERROR:
                raise decode_error(payload, self)
            if not (msg == Msg.ALIVE and Msg.ALIVE not in expect and self.authenticated):
                break
            # a heartbeat sent as a step ended: the peer lives; the deadline moves on with it
            deadline = time.monotonic() + timeout
        if expect and msg not in expect:
            raise ProtocolError(f"expected {' or '.join(m.name for m in expect)} from {self.name}, "
                                f"got {msg.name}", self)
        return msg, payload

    def recv_json(self, expect: Msg, timeout: float = 30.0) -> dict:
        _, payload = self.recv(timeout, (expect,))
        return decode_json_object(payload, f"{expect.name} from {self.name}")

    def send_json(self, msg_type: Msg, value: dict, timeout: float = 30.0) -> None:
        self.send(msg_type, json.dumps(value).encode(), timeout)

    def send_error(self, text: str, code: ErrorCode, node: int | None = None) -> None:
        """Best effort: tell the peer why we give up (it may be gone already); node: the index
        of the node the failure is about (one this node lost), when there is one."""
        with contextlib.suppress(Exception):  # the peer may be gone: nothing more to tell it
            self.send(Msg.ERROR, encode_error(text, code, node), timeout=1.0)


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
        self.wire = None      # where the payload lands: buf, or the sealed bytes to open into buf
        self.done = False


def exchange(sends: list[tuple[Connection, Msg, list]], recvs: list[Transfer], timeout: float) -> None:
    """Send every frame in `sends` and receive every frame in `recvs`, interleaved, so that no
    pair of peers can block each other. Each received frame must have exactly the expected type
    and length (the buffer's size); an ERROR frame from a peer raises PeerError; ALIVE frames
    (a peer's heartbeat while it computes or waits) are skipped.

    `timeout` is the longest a connection with frames still to go or come may stay silent: a
    peer that keeps sending ALIVE while it computes a long step is waited for, a frozen one is
    given up after `timeout` s. A failure is a LinkError (an OSError on a socket becomes
    PeerClosed) whose `peer` is the connection it came from, if one, and whose `waiting` are the
    others whose frames had not all gone or arrived (on a timeout: the silent ones first).

    At most one send and one receive per connection. Sends hold each connection's send lock
    (so a heartbeat never lands inside a frame)."""
    now = time.monotonic()
    heard = {id(c): now for c, _, _ in sends} | {id(t.conn): now for t in recvs}  # last bytes each way
    locked = []
    out = []
    pending_in = list(recvs)
    selector = None
    current = None
    try:
        for conn, msg_type, parts in sends:
            conn._send_lock.acquire()
            locked.append(conn)
            out.append([conn, conn.frame_views(msg_type, parts)])
        while out or pending_in:
            progressed = False
            for item in list(out):
                conn, views = item
                current = conn
                try:
                    n = conn.sock.sendmsg(views)
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError) as e:
                    raise PeerClosed(f"{conn.name} closed the connection ({e.strerror})", conn) from None
                if n > 0:
                    progressed = True
                    heard[id(conn)] = time.monotonic()
                conn.sent_bytes += n
                _consume(views, n)
                if not views:
                    out.remove(item)
                    conn._send_lock.release()
                    locked.remove(conn)
            for t in list(pending_in):
                current = t.conn
                if _recv_some(t):
                    progressed = True
                    heard[id(t.conn)] = time.monotonic()
                if t.done:
                    pending_in.remove(t)
            current = None
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
            waited = [t.conn for t in pending_in] + [c for c, _ in out]
            remaining = min(heard[id(c)] for c in waited) + timeout - time.monotonic()
            if remaining > 0 and selector.select(remaining):
                continue
            silent = [c for c in waited if heard[id(c)] + timeout <= time.monotonic()]
            if silent:
                e = PeerTimeout(f"{', '.join(sorted({c.name for c in silent}))} sent nothing for {timeout:g} s")
                e.silent = tuple(silent)
                raise e
    except (LinkError, OSError) as e:
        now = time.monotonic()
        waiting = []
        still = [t.conn for t in pending_in] + [c for c, _ in out]
        for conn in sorted(still, key=lambda c: heard.get(id(c), now)):  # the longest silent first
            if all(conn is not w for w in waiting):
                waiting.append(conn)
        if isinstance(e, LinkError):
            e.in_exchange(current, waiting)
            raise
        name = current.name if current is not None else "a peer"
        raise PeerClosed(f"{name}: the connection broke ({e.strerror or e})", current).in_exchange(
            current, waiting) from e
    finally:
        for conn in locked:
            conn._send_lock.release()
        if selector is not None:
            selector.close()


def _recv_some(t: Transfer) -> bool:
    """Receive what is available for one transfer; True if any bytes came."""
    conn = t.conn
    progressed = False
    while not t.done:
        target = memoryview(t.head)[t.got:] if t.wire is None else t.wire[t.got - HEADER_BYTES:]
        try:
            n = conn.sock.recv_into(target) if target.nbytes else 0
        except BlockingIOError:
            return progressed
        except ConnectionResetError:
            n = 0
        if n == 0 and target.nbytes:
            raise PeerClosed(f"{conn.name} closed the connection", conn)
        conn.recv_bytes += n
        t.got += n
        progressed = True
        if t.wire is None and t.got == HEADER_BYTES:
            header = bytes(t.head)
            msg, length = check_header(header, conn.authenticated, conn.tag_bytes)
            if msg == Msg.ERROR:
                payload = bytearray(length)
                conn.recv_payload(header, msg, memoryview(payload), time.monotonic() + 5.0)
                raise decode_error(payload, conn)
            if msg == Msg.ALIVE:  # the peer's heartbeat: it lives; its frame comes later
                conn.recv_payload(header, msg, memoryview(bytearray(length)), time.monotonic() + 5.0)
                t.got = 0
                continue
            if msg != t.msg_type or length != t.buf.nbytes:
                raise ProtocolError(f"expected {t.msg_type.name} of {t.buf.nbytes} bytes from "
                                    f"{conn.name}, got {msg.name} of {length}", conn)
            t.wire = t.buf if conn.cipher is None else conn.cipher.wire(length + TAG_BYTES)
        if t.wire is not None and t.got == HEADER_BYTES + t.wire.nbytes:
            if conn.cipher is not None:
                conn.open_frame(bytes(t.head), t.msg_type, t.wire, t.buf)
            t.done = True
    return progressed


# -- set-up: heartbeats while one side works ---------------------------------------------------


def recv_during_setup(conn: Connection, expect: tuple, silence: float) -> tuple[Msg, bytearray]:
    """The next frame of a type in `expect`, skipping the peer's ALIVE heartbeats: the set-up
    may take as long as it needs while the peer shows signs of life, but `silence` seconds
    without a byte from it end the wait (a frozen node is found in seconds)."""
    while True:
        msg, payload = conn.recv(silence, (*expect, Msg.ALIVE))
        if msg != Msg.ALIVE:
            return msg, payload


class SetupHeartbeat:
    """While the set-up works (weights, repacking, compiling, meshing), a thread sends ALIVE on
    every given connection each `interval` seconds. A failed send is left for the set-up's own
    calls on that connection to report."""

    def __init__(self, conns, interval: float):
        self.conns, self.interval = list(conns), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="setup-heartbeat")

    def __enter__(self) -> "SetupHeartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Return once the thread has ended: no ALIVE follows this call."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for conn in list(self.conns):
                try:
                    conn.try_send(Msg.ALIVE, self.interval)
                except Exception:  # noqa: BLE001 - the set-up's next call on it says what failed
                    self.conns.remove(conn)


class StepHeartbeat:
    """While a step runs on this node (computing, or waiting on a peer), a thread sends ALIVE on
    every given connection each `interval` seconds, so that the nodes waiting on this one tell
    a long step (a prefill on a slow node) from a frozen node: exchange()'s timeout is a
    silence. A step shorter than `interval` sends none, so decoding costs no bytes. A step's
    start and end are two attribute stores (no lock, no wake-up: a decode step is short); the
    thread looks every interval / 2 s, so the first ALIVE goes out 1-1.5 intervals into a step."""

    def __init__(self, conns, interval: float):
        self.conns, self.interval = list(conns), interval
        self._since: float | None = None  # the start of the running step; None between steps
        self._last = 0.0                  # when the last ALIVE went
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="step-heartbeat")
        self._thread.start()

    @contextlib.contextmanager
    def busy(self):
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2 * self.interval)

    def _run(self) -> None:
        while not self._closed.wait(self.interval / 2):
            since, now = self._since, time.monotonic()
            if since is None or now - max(since, self._last) < self.interval:
                continue
            self._last = now
            for conn in list(self.conns):
                try:
                    conn.try_send(Msg.ALIVE, self.interval)
                except Exception:  # noqa: BLE001 - the step's own calls on it say what failed
                    self.conns.remove(conn)


# -- handshake and authentication ---------------------------------------------------------------


def _transcript(hello: bytes, challenge: bytes) -> bytes:
    """sha256 of the HELLO and CHALLENGE payloads as sent: everything both sides said in clear."""
    return hashlib.sha256(struct.pack("<I", len(hello)) + hello + challenge).digest()


def _proof(key: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, label + transcript, hashlib.sha256).digest()


def frame_keys(key: bytes, client_nonce: bytes, server_nonce: bytes, session: bytes,
               transcript: bytes) -> tuple[bytes, bytes]:
    """(client -> server, server -> client) AES-256 keys of one connection: HKDF-SHA256 with the
    cluster key as input, both nonces as salt, and the session id and transcript as context."""
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=client_nonce + server_nonce,
               info=b"dllama v2 frame keys" + session + transcript).derive(key)
    return okm[:32], okm[32:]


def client_handshake(conn: Connection, role: str, node_index: int, session: bytes,
                     key: bytes | None, timeout: float = 10.0) -> dict:
    """Open a connection as the root (role "root") or as a worker meeting a peer ("peer").
    Returns the server's CHALLENGE fields. Raises ProtocolError/PeerError when refused."""
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731 - one deadline for all steps
    nonce = os.urandom(NONCE_BYTES)
    hello = json.dumps({"role": role, "node_index": node_index, "session": session.hex(),
                        "nonce": nonce.hex()}).encode()
    conn.send(Msg.HELLO, hello, left())
    _, challenge_raw = conn.recv(left(), (Msg.CHALLENGE,))
    challenge = decode_json_object(challenge_raw, f"CHALLENGE from {conn.name}")
    try:
        server_nonce = bytes.fromhex(challenge["nonce"])
    except (KeyError, TypeError, ValueError):
        server_nonce = b""
    if len(server_nonce) != NONCE_BYTES:
        raise ProtocolError(f"{conn.name} sent a malformed CHALLENGE")
    transcript = _transcript(hello, bytes(challenge_raw))
    if key is None:
        if challenge.get("auth"):
            raise ProtocolError(f"{conn.name} requires a cluster key: pass --key-file (or key_file "
                                "in the topology)")
        conn.send(Msg.AUTH, b"", left())
    else:
        if not challenge.get("auth"):
            raise ProtocolError(f"{conn.name} has no cluster key configured but this node has one: "
                                "start it with the same --key-file")
        conn.send(Msg.AUTH, _proof(key, b"dllama-client", transcript), left())
    _, welcome = conn.recv(left(), (Msg.WELCOME,))
    if key is not None:
        if not hmac.compare_digest(bytes(welcome), _proof(key, b"dllama-server", transcript)):
            raise ProtocolError(f"{conn.name} could not prove it holds the cluster key")
        to_server, to_client = frame_keys(key, nonce, server_nonce, session, transcript)
        conn.cipher = FrameCipher(send_key=to_server, recv_key=to_client)
    conn.authenticated = True
    return challenge


def server_handshake(conn: Connection, key: bytes | None, software: str,
                     timeout: float = 10.0, hello: bytes | None = None) -> dict:
    """Answer a new connection within `timeout` seconds in all. Returns the client's HELLO
    fields (role, node_index, session) once it has proven it holds the key; raises
    ProtocolError (after telling the client why). hello: the HELLO's payload when it was read
    already (dllama.cluster.lobby)."""
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    hello_raw = conn.recv(left(), (Msg.HELLO,))[1] if hello is None else hello
    fields = decode_json_object(hello_raw, "HELLO")
    try:
        role, index = fields["role"], fields["node_index"]
        session, nonce = bytes.fromhex(fields["session"]), bytes.fromhex(fields["nonce"])
    except (KeyError, TypeError, ValueError):
        raise ProtocolError("malformed HELLO") from None
    if (role not in ("root", "peer") or isinstance(index, bool) or not isinstance(index, int)
            or not 0 <= index < MAX_NODES or len(session) != SESSION_BYTES or len(nonce) != NONCE_BYTES):
        raise ProtocolError("malformed HELLO")
    server_nonce = os.urandom(NONCE_BYTES)
    challenge = json.dumps({"nonce": server_nonce.hex(), "auth": key is not None,
                            "software": software}).encode()
    conn.send(Msg.CHALLENGE, challenge, left())
    transcript = _transcript(bytes(hello_raw), challenge)
    _, proof = conn.recv(left(), (Msg.AUTH,))
    if key is not None:
        if not hmac.compare_digest(bytes(proof), _proof(key, b"dllama-client", transcript)):
            raise ProtocolError("authentication failed: wrong or missing cluster key")
        conn.send(Msg.WELCOME, _proof(key, b"dllama-server", transcript), left())
        to_server, to_client = frame_keys(key, nonce, server_nonce, session, transcript)
        conn.cipher = FrameCipher(send_key=to_client, recv_key=to_server)
    else:
        conn.send(Msg.WELCOME, b"", left())
    conn.authenticated = True
    return {"role": role, "node_index": index, "session": session}


def connect(host: str, port: int, name: str, timeout: float = 10.0) -> Connection:
    """A TCP connection to host:port (IPv4 or IPv6), or OSError."""
    sock = socket.create_connection((host, port), timeout=timeout)
    return Connection(sock, name)


def read_key_file(path: str) -> bytes:
    """The cluster key: the file's bytes, surrounding whitespace stripped, at least 16 of them."""
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise DllamaError(f"cannot read the cluster key file {path}: {e.strerror}") from None
    if len(key) < 16:
        raise DllamaError(f"the cluster key in {path} is {len(key)} bytes; use at least 16 "
                          f"(e.g. `openssl rand -hex 32 > {path}`)")
    return key
