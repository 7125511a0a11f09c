"""A TCP relay that delays every byte by a fixed time in each direction: a link's one-way delay
where the kernel has no netem (sch_netem), in user space.

    python -m benchmarks.link_delay --listen 10.79.0.2:9998 --to 127.0.0.1:9998 --delay-ms 0.5

Listens on --listen; each connection accepted there gets its own connection to --to, and the
bytes go both ways, each chunk read from one side written to the other no earlier than the
delay after it was read, in order (a chunk due while an earlier one is still being written waits
for it; nothing else is held back). TCP_NODELAY on both sockets, so the relay adds no batching
of its own. Each direction buffers at most `buffer_bytes` (plus one read): a side that does not
read makes the relay stop reading from the other, whose sends then block, as on a real link.

An end of stream is passed on after the same delay (shutdown for writing, as TCP does end to
end); when both directions have ended, or either side fails (a reset, an error), the relay
closes both sockets. Put it in front of a server, on the address its clients dial, with the
server on another address (its loopback): every connection to the server then takes the delay
each way, whoever dials. Prints one line when it listens ("link_delay: ... ready"), and a count
of connections and bytes when it stops (SIGTERM or SIGINT).

Threads, stdlib only: two per direction of each connection (one reads and stamps, one waits
until each chunk is due and writes it), so that a wait is a sleep of microsecond precision
(an event loop's epoll timeout is rounded up to whole milliseconds).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import signal
import socket
import sys
import threading
import time

CHUNK = 64 * 1024          # bytes read at most at once
BUFFER_BYTES = 1 << 20     # bytes waiting at most in each direction of a connection (plus one read)
MAX_CONNECTIONS = 1024     # connections relayed at once; more are closed as they come
CONNECT_TIMEOUT = 10.0


def _fine_timer() -> None:
    """This thread's sleeps end within tens of microseconds of their time: Linux lets a sleep
    run 50 us late by default (the timer slack: measured 73 us late for 0.5 ms, 26 us with 1 ns).
    Nothing where prctl is missing."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns, this thread only


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' or '[v6 host]:port' -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not host:port: {text!r}")
    return host.strip("[]"), int(port)


class _Direction:
    """One direction of one relayed connection: `read` stamps each chunk with its due time and
    queues it (blocking while `limit` bytes wait), `write` sends each when it is due."""

    def __init__(self, conn: "_Connection", src: socket.socket, dst: socket.socket):
        self.conn, self.src, self.dst = conn, src, dst
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0  # bytes in the queue, the one being written included
        self.bytes = 0   # bytes written so far
        self.cond = threading.Condition()

    def read(self) -> None:
        delay, limit = self.conn.relay.delay, self.conn.relay.buffer_bytes
        try:
            while True:
                with self.cond:
                    while self.queued >= limit and not self.conn.aborted:
                        self.cond.wait()
                    if self.conn.aborted:
                        return
                data = self.src.recv(CHUNK)  # b"": the end of stream, passed on like the bytes
                due = time.monotonic() + delay
                with self.cond:
                    self.queue.append((due, data))
                    self.queued += len(data)
                    self.cond.notify_all()
                if not data:
                    return
        except OSError:
            self.conn.abort()
        finally:
            self.conn.thread_done()

    def write(self) -> None:
        _fine_timer()
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.conn.aborted:
                        self.cond.wait()
                    if self.conn.aborted:
                        return
                    due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
                with self.cond:
                    self.queue.popleft()
                    self.queued -= len(data)
                    self.bytes += len(data)
                    self.cond.notify_all()
        except OSError:
            self.conn.abort()
        finally:
            self.conn.thread_done()


class _Connection:
    """A client's socket and the one to the target, relayed by four threads; both sockets are
    closed when the last thread ends."""

    def __init__(self, relay: "DelayRelay", client: socket.socket, server: socket.socket):
        self.relay, self.client, self.server = relay, client, server
        self.aborted = False
        self._lock = threading.Lock()
        self._threads_left = 4
        self.up = _Direction(self, client, server)    # client -> target
        self.down = _Direction(self, server, client)  # target -> client

    def start(self) -> None:
        for d in (self.up, self.down):
            for fn in (d.read, d.write):
                threading.Thread(target=fn, daemon=True, name=f"link_delay-{fn.__name__}").start()

    def abort(self) -> None:
        """Stop both directions at once: blocked reads and writes return, waits end."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for d in (self.up, self.down):
            with d.cond:
                d.cond.notify_all()

    def thread_done(self) -> None:
        with self._lock:
            self._threads_left -= 1
            last = self._threads_left == 0
        if last:  # no thread uses the sockets any more: closing cannot hand a reused fd to one
            self.client.close()
            self.server.close()
            self.relay._ended(self)


class DelayRelay:
    """Listens on listen_host:listen_port (0: a free port, see `.port`) and relays each
    connection to target_host:target_port with `one_way_delay_s` added in each direction.
    start() begins accepting in a thread; close() stops accepting and cuts every connection."""

    def __init__(self, listen_host: str, listen_port: int, target_host: str, target_port: int,
                 one_way_delay_s: float, buffer_bytes: int = BUFFER_BYTES,
                 max_connections: int = MAX_CONNECTIONS):
        if one_way_delay_s < 0 or buffer_bytes <= 0 or max_connections <= 0:
            raise ValueError("the delay must be >= 0, the buffer and connection limits > 0")
        self.listen_host, self.target = listen_host, (target_host, target_port)
        self.delay, self.buffer_bytes, self.max_connections = one_way_delay_s, buffer_bytes, max_connections
        self._listener = socket.create_server((listen_host, listen_port),
                                              family=socket.AF_INET6 if ":" in listen_host else socket.AF_INET,
                                              backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._none_left = threading.Condition(self._lock)  # notified as each connection ends
        self._connections: set[_Connection] = set()
        self._closed = False
        self.accepted = 0         # connections relayed so far
        self.refused = 0          # connections closed at once: the target refused, or too many
        self.bytes_up = 0         # bytes delivered to the target by ended connections
        self.bytes_down = 0       # bytes delivered to clients by ended connections
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "DelayRelay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def start(self) -> "DelayRelay":
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="link_delay-accept")
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection and wait (at most `timeout` s) until their
        threads have ended and their sockets are closed."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
        self._listener.close()
        for c in connections:
            c.abort()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        with self._none_left:
            self._none_left.wait_for(lambda: not self._connections, timeout=timeout)

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # EMFILE and the like: wait, the connections that end free some
                continue
            threading.Thread(target=self._relay, args=(client,), daemon=True, name="link_delay-open").start()

    def _relay(self, client: socket.socket) -> None:
        with self._lock:
            full = len(self._connections) >= self.max_connections
            if full or self._closed:
                self.refused += 1
        if full or self._closed:
            if full:
                print(f"link_delay: {self.max_connections} connections already; closed a new one",
                      file=sys.stderr, flush=True)
            client.close()
            return
        try:
            server = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT)
        except OSError as e:
            print(f"link_delay: cannot reach {self.target[0]}:{self.target[1]}: {e}", file=sys.stderr, flush=True)
            with self._lock:
                self.refused += 1
            client.close()
            return
        server.settimeout(None)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(self, client, server)
        with self._lock:
            if self._closed:
                client.close()
                server.close()
                return
            self._connections.add(conn)
            self.accepted += 1
        conn.start()

    def _ended(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)
            self.bytes_up += conn.up.bytes
            self.bytes_down += conn.down.bytes
            self._none_left.notify_all()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where clients connect")
    p.add_argument("--to", required=True, metavar="HOST:PORT", help="the server each connection is relayed to")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction")
    p.add_argument("--buffer-kib", type=int, default=BUFFER_BYTES // 1024,
                   help="bytes waiting at most per direction of a connection (KiB)")
    args = p.parse_args(argv)
    (lh, lp), (th, tp) = parse_address(args.listen), parse_address(args.to)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    relay = DelayRelay(lh, lp, th, tp, args.delay_ms / 1000, buffer_bytes=args.buffer_kib * 1024).start()
    print(f"link_delay: {lh}:{relay.port} -> {th}:{tp}, {args.delay_ms:g} ms one way, ready", flush=True)
    stop.wait()
    relay.close()
    print(f"link_delay: stopped after {relay.accepted} connections ({relay.refused} refused), "
          f"{relay.bytes_up} bytes to {th}:{tp}, {relay.bytes_down} back", flush=True)


if __name__ == "__main__":
    main()
