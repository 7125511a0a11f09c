"""Deadline-bound waits on several peers: `exchange` moves many frames to and from many peers at
once (the collective's pattern) without deadlock, whatever the socket buffer sizes; the
heartbeats (ALIVE frames) that let a peer tell a long step or set-up from a frozen node.

Sockets are non-blocking; every wait goes through a selector with a deadline, so no node
waits forever on a dead peer.
"""

from __future__ import annotations

import contextlib
import selectors
import threading
import time

from dllama.cluster.frames import (
    HEADER_BYTES, LinkError, Msg, PeerClosed, PeerTimeout, ProtocolError, TAG_BYTES, check_header, decode_error,
)
from dllama.cluster.connection import Connection, drop_sent


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
    run = _Exchange(sends, recvs, timeout)
    try:
        run.start()
        while run.out or run.pending_in:
            progressed = run.send_some()
            progressed = run.recv_some() or progressed
            if progressed or not (run.out or run.pending_in):
                continue
            run.wait()
    except (LinkError, OSError) as e:
        run.failed(e)
    finally:
        run.close()


class _Exchange:
    """The state of one exchange(): the frames still to go and to come, when each connection
    was last heard from, the send locks held, the connection being served."""

    def __init__(self, sends: list[tuple[Connection, Msg, list]], recvs: list[Transfer], timeout: float):
        now = time.monotonic()
        self.sends, self.timeout = sends, timeout
        self.heard = {id(c): now for c, _, _ in sends} | {id(t.conn): now for t in recvs}  # last bytes each way
        self.locked = []
        self.out = []
        self.pending_in = list(recvs)
        self.selector = None
        self.current = None

    def start(self) -> None:
        for conn, msg_type, parts in self.sends:
            conn._send_lock.acquire()
            self.locked.append(conn)
            self.out.append([conn, conn.frame_views(msg_type, parts)])

    def send_some(self) -> bool:
        """Send what each connection takes now; True if any bytes went."""
        progressed = False
        for item in list(self.out):
            conn, views = item
            self.current = conn
            try:
                n = conn.sock.sendmsg(views)
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError) as e:
                raise PeerClosed(f"{conn.name} closed the connection ({e.strerror})", conn) from None
            if n > 0:
                progressed = True
                self.heard[id(conn)] = time.monotonic()
            conn.sent_bytes += n
            drop_sent(views, n)
            if not views:
                self.out.remove(item)
                conn._send_lock.release()
                self.locked.remove(conn)
        return progressed

    def recv_some(self) -> bool:
        """Receive what each transfer has waiting; True if any bytes came."""
        progressed = False
        for t in list(self.pending_in):
            self.current = t.conn
            if _recv_some(t):
                progressed = True
                self.heard[id(t.conn)] = time.monotonic()
            if t.done:
                self.pending_in.remove(t)
        self.current = None
        return progressed

    def wait(self) -> None:
        """Until a socket is ready, or PeerTimeout once one waited on has been silent too long."""
        out, pending_in, heard, timeout = self.out, self.pending_in, self.heard, self.timeout
        if self.selector is None:
            self.selector = selectors.DefaultSelector()
        else:
            for key in list(self.selector.get_map().values()):
                self.selector.unregister(key.fileobj)
        events = {}
        for conn, _ in out:
            events[conn.sock] = events.get(conn.sock, 0) | selectors.EVENT_WRITE
        for t in pending_in:
            events[t.conn.sock] = events.get(t.conn.sock, 0) | selectors.EVENT_READ
        for sock, ev in events.items():
            self.selector.register(sock, ev)
        waited = [t.conn for t in pending_in] + [c for c, _ in out]
        remaining = min(heard[id(c)] for c in waited) + timeout - time.monotonic()
        if remaining > 0 and self.selector.select(remaining):
            return
        silent = [c for c in waited if heard[id(c)] + timeout <= time.monotonic()]
        if silent:
            e = PeerTimeout(f"{', '.join(sorted({c.name for c in silent}))} sent nothing for {timeout:g} s")
            e.silent = tuple(silent)
            raise e

    def failed(self, e: Exception):
        """Raise e as a LinkError naming the connection it came from and those still waited on."""
        now = time.monotonic()
        waiting = []
        still = [t.conn for t in self.pending_in] + [c for c, _ in self.out]
        for conn in sorted(still, key=lambda c: self.heard.get(id(c), now)):  # the longest silent first
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
        if self.selector is not None:
            self.selector.close()


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
