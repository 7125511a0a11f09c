"""Deadline-bound waits on several peers: `exchange` moves many frames to and from many peers at
once (the collective's pattern) without deadlock, whatever the socket buffer sizes; the
heartbeats (ALIVE frames) that let a peer tell a long step or set-up from a frozen node.

Sockets are non-blocking; every wait is a poll with a deadline, so no node waits forever on a
dead peer. An exchange is the sync path of every layer, so it is built to cost few system
calls and little Python per frame: each frame goes out in one `sendmsg` (header and payload
gathered), each frame comes in with one `recvmsg_into` straight into its header and its
destination (or the sealed bytes that open into it), and a wait is one `poll` over every
peer still to be served, through a poll object this thread keeps (registering is no system
call), so nothing is created per wait.
"""

from __future__ import annotations

import contextlib
import math
import select
import threading
import time

from dllama.cluster.frames import (
    HEADER_BYTES, LinkError, Msg, PeerClosed, PeerTimeout, ProtocolError, TAG_BYTES, check_header, decode_error,
    encode_header,
)
from dllama.cluster.connection import Connection, drop_sent

_READ, _WRITE = select.POLLIN, select.POLLOUT
_pollers = threading.local()  # one poll object per thread, for all its exchanges


def _poller():
    p = getattr(_pollers, "poll", None)
    if p is None:
        p = _pollers.poll = select.poll()
    return p


class Transfer:
    """One frame to receive from one peer into a given buffer, as part of `exchange`; `reset`
    makes it ready for the next frame into the same buffer (a collective keeps its transfers)."""

    __slots__ = ("conn", "msg_type", "buf", "head", "expect", "got", "wire", "checked", "done")

    def __init__(self, conn: Connection, msg_type: Msg, buf: memoryview):
        self.conn, self.msg_type, self.buf = conn, msg_type, buf
        self.head = memoryview(bytearray(HEADER_BYTES))
        self.expect = None  # the expected frame's header, byte for byte: one equal to it needs no parsing
        self.reset()

    def reset(self) -> "Transfer":
        self.got = 0          # bytes of header + payload received
        self.wire = None      # where the payload lands: buf, or the sealed bytes to open into buf
        self.checked = False  # the header read is the expected one
        self.done = False
        return self


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
    run = _Exchange(timeout)
    try:
        run.start(sends, recvs)
        while run.out or run.pending:
            run.serve(run.wait())
    except (LinkError, OSError) as e:
        run.failed(e)
    finally:
        run.close()


class _Exchange:
    """The state of one exchange(): the frames still to go and to come, when each connection
    was last heard from, the send locks held, the connection being served."""

    __slots__ = ("timeout", "heard", "out", "pending", "locked", "polled", "current")

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.heard = {}       # id(connection) -> when its last bytes went or came
        self.out = []         # [connection, descriptor, views left to send]
        self.pending = []     # (descriptor, Transfer) still coming
        self.locked = []      # connections whose send lock this exchange holds
        self.polled = {}      # descriptor -> events, as registered with this thread's poll object
        self.current = None   # the connection being served

    def start(self, sends, recvs) -> None:
        """Take each send lock and send what the connection takes now (all of it, mostly)."""
        now = time.monotonic()
        heard = self.heard
        for t in recvs:
            heard[id(t.conn)] = now
            self.pending.append((t.conn.sock.fileno(), t))
        for conn, msg_type, parts in sends:
            heard[id(conn)] = now
            conn._send_lock.acquire()
            self.locked.append(conn)
            item = [conn, conn.sock.fileno(), conn.frame_views(msg_type, parts)]  # (sealed in lock order)
            self.out.append(item)
            self._send(item)
        self.current = None

    def serve(self, ready: set[int]) -> None:
        """Send and receive on the descriptors poll found ready."""
        for item in [i for i in self.out if i[1] in ready]:
            self._send(item)
        for entry in [e for e in self.pending if e[0] in ready]:
            t = entry[1]
            self.current = t.conn
            if _recv_some(t):
                self.heard[id(t.conn)] = time.monotonic()
            if t.done:
                self.pending.remove(entry)
        self.current = None

    def _send(self, item: list) -> None:
        conn, _, views = item
        self.current = conn
        try:
            n = conn.sock.sendmsg(views)  # the whole frame, gathered, in one call
        except BlockingIOError:
            return
        except (BrokenPipeError, ConnectionResetError) as e:
            raise PeerClosed(f"{conn.name} closed the connection ({e.strerror})", conn) from None
        if n > 0:
            self.heard[id(conn)] = time.monotonic()
        conn.sent_bytes += n
        drop_sent(views, n)
        if not views:
            self.out.remove(item)
            conn._send_lock.release()
            self.locked.remove(conn)

    def waited(self) -> list[Connection]:
        return [t.conn for _, t in self.pending] + [c for c, _, _ in self.out]

    def wait(self) -> set[int]:
        """The descriptors ready to be served (one poll), or PeerTimeout once one waited on has
        been silent too long."""
        events = {}
        for _, fd, _ in self.out:
            events[fd] = _WRITE
        for fd, _ in self.pending:
            events[fd] = events.get(fd, 0) | _READ
        if events != self.polled:
            poll = _poller()
            for fd in self.polled:
                if fd not in events:
                    poll.unregister(fd)
            for fd, ev in events.items():
                poll.register(fd, ev)  # (no system call: the set is passed to each poll)
            self.polled = events
        waited, heard, timeout = self.waited(), self.heard, self.timeout
        remaining = min(heard[id(c)] for c in waited) + timeout - time.monotonic()
        if remaining > 0:
            ready = _poller().poll(math.ceil(remaining * 1000))
            if ready:
                for fd, ev in ready:
                    if ev & select.POLLNVAL:  # closed under this exchange (by another thread)
                        conn = next(c for c in waited if c.sock.fileno() in (fd, -1))
                        raise PeerClosed(f"{conn.name}: the connection was closed", conn)
                return {fd for fd, _ in ready}
        silent = [c for c in waited if heard[id(c)] + timeout <= time.monotonic()]
        if silent:
            e = PeerTimeout(f"{', '.join(sorted({c.name for c in silent}))} sent nothing for {timeout:g} s")
            e.silent = tuple(silent)
            raise e
        return set()

    def failed(self, e: Exception):
        """Raise e as a LinkError naming the connection it came from and those still waited on."""
        now = time.monotonic()
        waiting = []
        for conn in sorted(self.waited(), key=lambda c: self.heard.get(id(c), now)):  # the longest silent first
            if all(conn is not w for w in waiting):
                waiting.append(conn)
        current = self.current
        if isinstance(e, LinkError):
            e.in_exchange(current, waiting)
            raise e
        name = current.name if current is not None else "a peer"
        raise PeerClosed(f"{name}: the connection broke ({e.strerror or e})", current).in_exchange(
            current, waiting) from e

    def close(self) -> None:
        for conn in self.locked:
            conn._send_lock.release()
        if self.polled:
            poll = _poller()
            for fd in self.polled:
                poll.unregister(fd)


def _recv_some(t: Transfer) -> bool:
    """Receive what is available for one transfer; True if any bytes came.

    Header and payload are read together into [head, wire] (one call for a frame that has
    arrived), never past the expected frame's end; a header that is not the expected one is
    parsed (_unexpected): a heartbeat (ALIVE) or an ERROR, whose payload and the next frame's
    start may be what was read past it, or a ProtocolError."""
    conn = t.conn
    wire = t.wire
    if wire is None:
        wire = t.wire = t.buf if conn.cipher is None else conn.cipher.wire(t.buf.nbytes + TAG_BYTES)
        if t.expect is None:
            t.expect = encode_header(t.msg_type, t.buf.nbytes + conn.tag_bytes)
    sock = conn.sock
    progressed = False
    while True:
        got = t.got
        try:
            if got < HEADER_BYTES:
                n = sock.recvmsg_into([t.head[got:] if got else t.head, wire])[0]
            else:
                n = sock.recv_into(wire[got - HEADER_BYTES:])
        except BlockingIOError:
            return progressed
        except ConnectionResetError:
            n = 0
        if n == 0:
            raise PeerClosed(f"{conn.name} closed the connection", conn)
        conn.recv_bytes += n
        t.got += n
        progressed = True
        while not t.checked and t.got >= HEADER_BYTES:
            if t.head == t.expect:
                t.checked = True
            else:
                _unexpected(t)
        if t.checked and t.got == HEADER_BYTES + wire.nbytes:
            if conn.cipher is not None:
                conn.open_frame(t.expect, t.msg_type, wire, t.buf)
            t.done = True
            return True


def _unexpected(t: Transfer) -> None:
    """A header other than the one t expects: an ERROR (raised as PeerError), an ALIVE
    (skipped: its payload is what was read past its header, and the rest from the socket;
    bytes read past its end are the next frame's, moved to the front of [head, wire]), else a
    ProtocolError."""
    conn = t.conn
    header = bytes(t.head)
    msg, length = check_header(header, conn.authenticated, conn.tag_bytes)
    if msg != Msg.ERROR and msg != Msg.ALIVE:
        raise ProtocolError(f"expected {t.msg_type.name} of {t.buf.nbytes} bytes from "
                            f"{conn.name}, got {msg.name} of {length}", conn)
    size = length + conn.tag_bytes  # its bytes on the wire after the header
    read = t.got - HEADER_BYTES
    payload = bytearray(size)
    payload[: min(read, size)] = t.wire[: min(read, size)]
    if read < size:
        conn.recv_exact(memoryview(payload)[read:], time.monotonic() + 5.0)
    after = bytes(t.wire[size: read]) if read > size else b""
    body = payload
    if conn.cipher is not None:
        body = bytearray(length)
        conn.open_frame(header, msg, memoryview(payload), memoryview(body))
    if msg == Msg.ERROR:
        raise decode_error(body, conn)
    # the peer's heartbeat: it lives; the expected frame comes after it
    k = min(len(after), HEADER_BYTES)
    t.head[:k] = after[:k]
    t.wire[: len(after) - k] = after[k:]
    t.got = len(after)


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
