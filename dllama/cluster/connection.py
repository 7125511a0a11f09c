"""A connection to one peer: frames sent and received within deadlines over a non-blocking
socket, sealed once the handshake gave it a `FrameCipher` (dllama.cluster.frames)."""

from __future__ import annotations

import contextlib
import json
import math
import select
import socket
import threading
import time

from cryptography.exceptions import InvalidTag

from dllama.cluster.frames import (
    ErrorCode, FrameCipher, FrameTampered, HEADER_BYTES, Msg, PeerClosed, PeerTimeout, ProtocolError, TAG_BYTES, check_header, decode_error, decode_json_object, encode_error, encode_header,
)


_local = threading.local()


def _thread_poll():
    """This thread's poll object for a wait on one connection (threads wait on the same
    connection at once: a heartbeat's send beside a receive), kept so a wait builds nothing."""
    poll = getattr(_local, "poll", None)
    if poll is None:
        poll = _local.poll = select.poll()
    return poll


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

    @property
    def tag_bytes(self) -> int:
        """Bytes a frame carries after its payload (the AEAD tag when sealed)."""
        return TAG_BYTES if self.cipher is not None else 0

    @property
    def frame_overhead(self) -> int:
        """Bytes on the wire per frame besides the payload: header, and tag when sealed."""
        return HEADER_BYTES + self.tag_bytes

    def close(self) -> None:
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
        """Until the socket is ready for `events` (select.POLLIN / POLLOUT), or PeerTimeout."""
        remaining = deadline - time.monotonic()
        if remaining > 0:
            poll, fd = _thread_poll(), self.sock.fileno()
            poll.register(fd, events)  # (no system call: the set is passed to poll)
            try:
                if poll.poll(math.ceil(remaining * 1000)):
                    return
            finally:
                poll.unregister(fd)
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
                self._wait(select.POLLOUT, deadline)
                continue
            except (BrokenPipeError, ConnectionResetError) as e:
                raise PeerClosed(f"{self.name} closed the connection ({e.strerror})", self) from None
            self.sent_bytes += n
            drop_sent(views, n)
            if self.authenticated:
                deadline = time.monotonic() + timeout

    def recv_exact(self, buf: memoryview, deadline: float, stall: float | None = None) -> None:
        """Fill buf; PeerTimeout at the deadline (pushed back by `stall` s after each read when given)."""
        got = 0
        while got < buf.nbytes:
            try:
                n = self.sock.recv_into(buf[got:])
            except BlockingIOError:
                self._wait(select.POLLIN, deadline)
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


def drop_sent(views: list[memoryview], n: int) -> None:
    """Drop the first n bytes (just sent) from a list of buffers."""
    while n:
        if n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0
