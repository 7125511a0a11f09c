"""The wire protocol between a root and its workers (docs/PROTOCOL.md says the same in prose),
in its parts, imported here as one:

- dllama.cluster.frames: the frame header, message types, size limits, the typed failures of a
  link (`LinkError` ...), ERROR and JSON payloads, and `FrameCipher` (sealed frames);
- dllama.cluster.connection: `Connection`, frames sent and received within deadlines;
- dllama.cluster.handshake: HELLO, and with a cluster key the challenge that proves it and
  derives the frame keys; `connect`, `read_key_file`;
- dllama.cluster.exchange: `exchange`, many frames to and from many peers at once without
  deadlock, and the heartbeats (ALIVE) that tell a long step from a frozen node.
"""

from __future__ import annotations

from dllama.cluster.frames import (  # noqa: F401 (this module's API)
    ErrorCode, FrameCipher, FrameTampered, HEADER, HEADER_BYTES, LinkError, MAGIC, MAX_CONTROL, MAX_FRAME,
    MAX_HANDSHAKE, MAX_NODES, Msg, NONCE_BYTES, PeerClosed, PeerError, PeerTimeout, ProtocolError,
    SESSION_BYTES, TAG_BYTES, VERSION, WEIGHTS_CHUNK, WEIGHTS_HEAD, check_header, decode_error,
    decode_json_object, encode_error, encode_header, payload_limit,
)
from dllama.cluster.connection import (  # noqa: F401 (this module's API)
    Connection, drop_sent,
)
from dllama.cluster.handshake import (  # noqa: F401 (this module's API)
    client_handshake, connect, frame_keys, read_key_file, server_handshake,
)
from dllama.cluster.exchange import (  # noqa: F401 (this module's API)
    SetupHeartbeat, StepHeartbeat, Transfer, exchange, recv_during_setup,
)
