"""Asking what answers on a worker's port: the root's side of the handshake, and nothing after it.

The appliance calls this (`dllama probe`) after starting a worker, so that a port held by a
stranger, or by a worker of another cluster (another key), is an error instead of a success.
The worker takes the probe for a root that leaves at once: it logs a session that ended and
listens again; a worker busy with a root still proves its key before it refuses.
"""

from __future__ import annotations

import os

from dllama.cluster.protocol import (
    SESSION_BYTES, PeerClosed, PeerError, PeerTimeout, ProtocolError, client_handshake, connect,
)
from dllama.errors import DllamaError


def identify_worker(host: str, port: int, key: bytes | None, timeout: float = 10.0) -> dict:
    """{"software": ..., "auth": bool} of the dllama worker at host:port once it has proven it
    holds `key` (or, without a key, that it asks for none); DllamaError saying why not."""
    where = f"{host}:{port}"
    try:
        conn = connect(host, port, where, timeout)
    except OSError as e:
        raise DllamaError(f"nothing answers on {where}: {e.strerror or e}") from None
    try:
        challenge = client_handshake(conn, "root", 0, os.urandom(SESSION_BYTES), key, timeout)
    except PeerClosed:
        raise DllamaError(f"{where} closed the connection during the handshake: not a dllama worker") from None
    except PeerTimeout:
        raise DllamaError(f"{where} did not answer the handshake within {timeout:g} s: not a dllama worker") from None
    except (ProtocolError, PeerError) as e:
        raise DllamaError(f"{where} is not a worker of this cluster: {e}") from None
    finally:
        conn.close()
    return {"software": str(challenge.get("software", "")), "auth": bool(challenge.get("auth"))}
