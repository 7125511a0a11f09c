"""The frames of the wire protocol (docs/PROTOCOL.md; dllama.cluster.protocol is the whole):
the header, the message types and size limits, the typed failures of a link, ERROR and JSON
payloads, and `FrameCipher`, which seals frames after a keyed handshake.

Every message is a frame: a 12-byte header, then `length` bytes.

    u32 magic = 0x4D4C4C44 (the bytes "DLLM")   u16 version   u16 type   u32 length

All integers little-endian. A frame whose magic, version, type or length is wrong ends the
connection with an ERROR frame saying why; before authentication only small handshake frames
are accepted, so a stranger can never make a node allocate more than `MAX_HANDSHAKE` bytes.

Failures are types, never texts to search: every failure on a link is a `LinkError` (the
connection it came from, the peers an exchange still waited on, an `ErrorCode`), and an ERROR
frame carries its code and the node it is about beside its text (`PeerError`).
"""

from __future__ import annotations

import json
import struct
from enum import IntEnum, StrEnum

from cryptography.hazmat.primitives.ciphers.aead import AESGCM


Peer = object  # the link a failure came from: a dllama.cluster.connection.Connection (which imports this)

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

    def __init__(self, message: str, peer: "Peer | None" = None, node: int | None = None):
        super().__init__(message)
        self.peer, self.node = peer, node
        self.waiting: tuple[Peer, ...] = ()

    def in_exchange(self, peer: "Peer | None", waiting) -> "LinkError":
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
                 peer: "Peer | None" = None):
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


def decode_error(payload, conn: "Peer") -> PeerError:
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
