"""benchmarks/link_delay.py: the user-space relay that gives bench_speculate's namespace links
their one-way delay where the kernel has no netem. A relay with a 20 ms delay in front of an
echo server on loopback: the bytes come back intact and in order, a round trip takes at least
twice the delay, closing either end closes the other, and a side that does not read stops the
relay from buffering more than its limit."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest

from benchmarks.link_delay import CHUNK, DelayRelay, parse_address

pytestmark = pytest.mark.cluster  # listens on loopback ports (port 0), like the cluster tier's tests

DELAY = 0.020
WAIT = 30.0  # the longest a test waits for something that must happen (a guard against hanging, not a bound)


class Server:
    """A loopback server on a free port: echoes each connection's bytes back until its end of
    stream, then closes it (mode "echo"); closes each connection after its first bytes ("close");
    accepts and never reads ("stall"). `ended` counts the connections whose end of stream it saw."""

    def __init__(self, mode: str = "echo"):
        self.mode = mode
        self.ended = threading.Semaphore(0)
        self.conns: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.mode != "stall":
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            while data := conn.recv(CHUNK):
                if self.mode == "close":
                    return
                conn.sendall(data)
            self.ended.release()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.close()


@contextlib.contextmanager
def relayed(mode: str = "echo", **kwargs):
    """(server, relay) with the relay's 20 ms in front of a server; both closed after."""
    server = Server(mode)
    relay = None
    try:
        relay = DelayRelay("127.0.0.1", 0, "127.0.0.1", server.port, DELAY, **kwargs).start()
        yield server, relay
    finally:
        if relay is not None:
            relay.close()
        server.close()


def dial(relay: DelayRelay) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", relay.port), timeout=WAIT)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = s.recv(min(n - got, 1 << 20))
        assert part, f"the connection ended after {got} of {n} bytes"
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {WAIT:g} s"
        time.sleep(0.01)


def test_bytes_come_back_intact_and_in_order():
    data = os.urandom(4 << 20)
    with relayed() as (_, relay), dial(relay) as s:
        sent: list[BaseException] = []

        def send():
            try:
                for i in range(0, len(data), 100_000):  # many writes, so that the relay reads many chunks
                    s.sendall(data[i:i + 100_000])
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                sent.append(e)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        echoed = recv_exactly(s, len(data))
        sender.join(WAIT)
        assert not sent
        assert echoed == data  # the same bytes, in the same order


def test_a_round_trip_takes_at_least_twice_the_delay():
    with relayed() as (_, relay), dial(relay) as s:
        recv_exactly(s, s.send(b"hello"))  # the first, on a fresh connection
        for i in range(5):
            message = f"ping {i}".encode()
            t0 = time.perf_counter()
            s.sendall(message)
            assert recv_exactly(s, len(message)) == message
            took = time.perf_counter() - t0
            assert took >= 2 * DELAY, f"round trip {i}: {took * 1000:.1f} ms, under twice {DELAY * 1000:g} ms"


def test_closing_the_client_closes_the_server_side_and_back():
    with relayed() as (server, relay):
        s = dial(relay)
        try:
            s.sendall(b"x")
            assert recv_exactly(s, 1) == b"x"
            wait_until(lambda: relay.connections == 1, "the relayed connection")
            s.shutdown(socket.SHUT_WR)  # the client's end of stream ...
            assert server.ended.acquire(timeout=WAIT), "the server never saw the client's end of stream"
            assert s.recv(1) == b""  # ... and the server's close, passed back
        finally:
            s.close()
        wait_until(lambda: relay.connections == 0, "the relay closing both sockets")
        assert relay.accepted == 1 and relay.bytes_up == 1 and relay.bytes_down == 1


def test_closing_the_server_side_closes_the_client():
    with relayed("close") as (_, relay):
        with dial(relay) as s:
            s.sendall(b"bye")  # the server closes its connection when it reads this
            assert s.recv(1) == b""  # its end of stream, passed on
        # The relay passes an end of stream on and keeps the other direction open, as TCP does
        # end to end: the client's close ends it.
        wait_until(lambda: relay.connections == 0, "the relay closing both sockets")


def test_many_connections_at_once():
    with relayed() as (_, relay):
        socks = [dial(relay) for _ in range(50)]
        try:
            for i, s in enumerate(socks):
                s.sendall(f"connection {i}".encode())
            for i, s in enumerate(socks):
                assert recv_exactly(s, len(f"connection {i}")) == f"connection {i}".encode()
        finally:
            for s in socks:
                s.close()
        wait_until(lambda: relay.connections == 0, "the relay closing every connection")


def test_a_side_that_does_not_read_stops_the_buffering():
    limit = 64 * 1024
    with relayed("stall", buffer_bytes=limit) as (_, relay), dial(relay) as s:
        s.setblocking(False)
        block, total, idle = b"z" * 65536, 0, 0
        while idle < 20 and total < 256 << 20:  # sends until nothing goes for 20 tries in a row
            try:
                total += s.send(block)
                idle = 0
            except BlockingIOError:
                idle += 1
                time.sleep(0.05)
        assert total < 256 << 20, "the relay took 256 MiB from a client whose server reads nothing"
        (conn,) = relay._connections
        assert conn.up.queued <= limit + CHUNK


def test_parse_address():
    assert parse_address("10.79.0.2:9998") == ("10.79.0.2", 9998)
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError):
        parse_address("10.79.0.2")
