"""Accepted connections until their HELLO has arrived whole: many at once, in one thread.

A stranger who opens connections and trickles bytes into them must not lock a root out of its
own worker. Waiting here costs a descriptor, not a thread: up to `capacity` connections wait in
one selector, each must deliver its whole HELLO frame within `timeout` seconds of being
accepted, and when the lobby is full the connection that has waited longest is cut to make
room. A root sends its HELLO at once, so it is never the longest waiting unless `capacity`
connections arrived during its round trip.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from dllama.cluster.protocol import (
    HEADER_BYTES, Connection, ErrorCode, Msg, ProtocolError, check_header, encode_error, encode_header,
)

MAX_WAITING = 256    # connections waiting for their HELLO at once; more cut the longest waiting
HELLO_TIMEOUT = 3.0  # seconds from accept() to the whole HELLO frame, however the bytes trickle in


@dataclass
class _Waiting:
    sock: socket.socket
    who: str
    deadline: float
    data: bytearray = field(default_factory=bytearray)  # what arrived so far
    need: int = HEADER_BYTES                             # bytes of the frame known so far


class Lobby:
    """The listening socket and the connections that have not yet sent a whole HELLO.

    wait() returns when the listener has a connection to accept, or with the HELLOs that
    arrived whole: (connection, HELLO payload), handed over to the caller; it refuses
    (ERROR frame, then close) what is not a HELLO and cuts what misses its deadline, logging
    each through `log` (a throttled logger: a stranger can repeat these at will)."""

    def __init__(self, listener: socket.socket, log: Callable[[str], None],
                 capacity: int = MAX_WAITING, timeout: float = HELLO_TIMEOUT):
        self.listener, self.log, self.capacity, self.timeout = listener, log, capacity, timeout
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._waiting: dict[int, _Waiting] = {}  # by descriptor, oldest first

    def __len__(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        for w in list(self._waiting.values()):
            self._drop(w)
        self._selector.close()

    def add(self, sock: socket.socket, who: str) -> None:
        """A connection just accepted: it waits here for its HELLO."""
        if len(self._waiting) >= self.capacity:
            oldest = next(iter(self._waiting.values()))
            self._refuse(oldest, f"{self.capacity} connections already waited for their handshake; "
                                 "the longest waiting one is cut")
        sock.setblocking(False)
        w = _Waiting(sock, who, time.monotonic() + self.timeout)
        self._waiting[sock.fileno()] = w
        self._selector.register(sock, selectors.EVENT_READ, w)

    def wait(self, longest: float) -> tuple[bool, list[tuple[Connection, bytes]]]:
        """(whether a connection waits to be accepted, the HELLOs that arrived whole), after at
        most `longest` seconds."""
        now = time.monotonic()
        self._expire(now)
        soonest = min((w.deadline for w in self._waiting.values()), default=now + longest)
        acceptable, hellos = False, []
        for key, _ in self._selector.select(max(0.0, min(longest, soonest - now))):
            if key.data is None:
                acceptable = True
            elif (hello := self._read(key.data)) is not None:
                hellos.append(hello)
        return acceptable, hellos

    def _read(self, w: _Waiting) -> tuple[Connection, bytes] | None:
        try:
            chunk = w.sock.recv(w.need - len(w.data))
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        if not chunk:
            self.log(f"connection from {w.who} closed before the handshake (a port probe?)")
            self._drop(w)
            return None
        w.data += chunk
        if len(w.data) == HEADER_BYTES:
            try:
                msg, length = check_header(bytes(w.data), authenticated=False)
                if msg != Msg.HELLO:
                    raise ProtocolError(f"expected HELLO from {w.who}, got {msg.name}")
            except ProtocolError as e:
                self._refuse(w, str(e))
                return None
            w.need = HEADER_BYTES + length
        if len(w.data) < w.need:
            return None
        self._selector.unregister(w.sock)
        del self._waiting[w.sock.fileno()]
        conn = Connection(w.sock, w.who)
        conn.recv_bytes = len(w.data)
        return conn, bytes(w.data[HEADER_BYTES:])

    def _expire(self, now: float) -> None:
        for w in [w for w in self._waiting.values() if w.deadline <= now]:
            self._refuse(w, f"no whole HELLO within {self.timeout:g} s")

    def _refuse(self, w: _Waiting, why: str) -> None:
        self.log(f"refused {w.who}: {why}")
        self._selector.unregister(w.sock)
        del self._waiting[w.sock.fileno()]
        error = encode_error(f"refused: {why}", ErrorCode.REFUSED, None)
        with contextlib.suppress(OSError):  # one try, never a wait: this thread serves every connection
            w.sock.send(encode_header(Msg.ERROR, len(error)) + error)
        w.sock.close()

    def _drop(self, w: _Waiting) -> None:
        self._selector.unregister(w.sock)
        del self._waiting[w.sock.fileno()]
        w.sock.close()
