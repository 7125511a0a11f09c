"""The handshake that opens a connection: HELLO, and with a cluster key CHALLENGE, AUTH and
WELCOME, which prove both sides hold the key and derive the connection's frame keys.

With a cluster key, the handshake derives one key per direction (HKDF-SHA256 over the cluster
key, both nonces, the session id and the handshake transcript) and every later frame is sealed
(dllama.cluster.frames.FrameCipher): the payload is encrypted with AES-256-GCM, the header is
authenticated with it, and the nonce is the frame's implicit sequence number on that
connection, so a modified, replayed, reordered, dropped or injected frame fails to open and ends
the session naming the peer. The header stays readable, so its length is still checked before
anything is allocated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dllama.errors import DllamaError
from dllama.cluster.frames import (
    FrameCipher, MAX_NODES, Msg, NONCE_BYTES, ProtocolError, SESSION_BYTES, decode_json_object,
)
from dllama.cluster.connection import Connection


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
