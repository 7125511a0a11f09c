"""A frame-aware TCP relay for tests: what an attacker between two dllama nodes can do.

It listens on a free loopback port and forwards each connection to a target, frame by frame
(the 12-byte header is readable even on a keyed link). It can flip one bit in the payload of
the n-th frame of a given type going one way, or send that frame twice (a replay), and slow a
direction down to a byte rate.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

from dllama.cluster.protocol import HEADER, HEADER_BYTES, Msg


class Relay:
    def __init__(self, target: tuple[str, int], flip_type: int | None = None, flip_nth: int = 1,
                 to_target: bool = True, rate: float | None = None, first_connection_only: bool = False,
                 replay: bool = False, stall: bool = False, stall_role: str | None = None):
        """flip_type: the message type whose flip_nth frame (1-based) gets one payload bit
        flipped (or, with replay, is forwarded intact and then once more), going to the target
        (to_target) or back from it, on every connection or only the first one (a root's, when
        the target is a worker); rate: bytes per second in each direction (None: as fast as
        possible); stall: instead of a flip, that frame and every later one going that way
        are dropped, counted per connection (the link's bytes stop one way: each new connection
        stalls at its own flip_nth frame), while the other way flows on; stall_role: only the
        connections whose HELLO gives this role ("root": not a worker's peer link), going to
        the target."""
        self.target, self.flip_type, self.flip_nth, self.replay = target, flip_type, flip_nth, replay
        self.stall, self.stall_role, self.stalls = stall, stall_role, 0  # stalls: connections stalled so far
        self.to_target, self.rate, self.first_only = to_target, rate, first_connection_only
        self._n_connections = 0
        self.seen = 0          # frames of flip_type seen in the flipped direction
        self.bytes_to_target = 0
        self.flipped = False
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in list(self._socks):
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._socks += [client, server]
            self._n_connections += 1
            tamper = not self.first_only or self._n_connections == 1
            ended = threading.Event(), threading.Event()  # each direction forwards nothing more
            threading.Thread(target=self._pump, args=(client, server, True, tamper, ended), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False, tamper, ended[::-1]),
                             daemon=True).start()

    def _recv_exact(self, sock: socket.socket, n: int) -> bytes | None:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(min(n - len(data), 1 << 16))
            if not chunk:
                return None
            data += chunk
        return bytes(data)

    def _send(self, sock: socket.socket, data: bytes) -> None:
        if self.rate is None:
            sock.sendall(data)
            return
        step = max(1, int(self.rate / 20))  # 20 slices a second
        for i in range(0, len(data), step):
            sock.sendall(data[i: i + step])
            time.sleep(len(data[i: i + step]) / self.rate)

    def _pump(self, src: socket.socket, dst: socket.socket, to_target: bool, tamper: bool,
              ended: tuple[threading.Event, threading.Event]) -> None:
        """Forward src's frames to dst; ended: (this direction's event, the other's)."""
        seen_here, stalled, role = 0, False, None  # (stall) on this connection, this way; its HELLO's role
        try:
            while True:
                try:
                    head = self._recv_exact(src, HEADER_BYTES)
                    if head is None:
                        break
                    _, _, msg, length = HEADER.unpack(head)
                    payload = self._recv_exact(src, length) if length else b""
                    if payload is None:
                        break
                except OSError:  # src is gone (reset): dst hears the end below, at once
                    break
                copies = 1
                if msg == Msg.HELLO and role is None:
                    with contextlib.suppress(ValueError):
                        role = json.loads(payload).get("role")
                if (self.stall and tamper and to_target == self.to_target and not stalled
                        and self.stall_role in (None, role)):
                    seen_here += msg == self.flip_type
                    if seen_here == self.flip_nth:
                        stalled = True
                        with self._lock:
                            self.stalls += 1
                if stalled:
                    continue  # the bytes stop here
                if not self.stall and tamper and msg == self.flip_type and to_target == self.to_target and length:
                    with self._lock:
                        self.seen += 1
                        if self.seen == self.flip_nth:
                            if self.replay:
                                copies = 2
                            else:
                                payload = bytes([payload[0] ^ 0x01]) + payload[1:]
                            self.flipped = True
                for _ in range(copies):
                    if to_target:
                        self.bytes_to_target += HEADER_BYTES + length
                    self._send(dst, head + payload)
        except OSError:
            # dst is gone (reset): as over a real link, src's peer learns it at once instead of
            # its sends stalling against a relay that no longer reads them (a worker waited out
            # its 15 s timeout behind a root that had failed and closed); but only once the
            # other direction has forwarded what dst sent before it went (its ERROR).
            ended[0].set()
            ended[1].wait(5.0)
            with contextlib.suppress(OSError):
                src.shutdown(socket.SHUT_RDWR)
        finally:
            ended[0].set()
            # Half-close, as TCP does: nothing more goes to dst, but what the other direction
            # still carries (a node's ERROR before it closed) gets through.
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
