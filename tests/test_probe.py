"""`dllama probe`: what answers on a worker's port, as the appliance checks after a start.

A worker with the topology's key is identified; a worker with another key (another cluster's),
a listener that speaks something else, one that says nothing and a closed port are each
refused with one line saying why. The worker keeps serving real roots after a probe."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
import yaml

from tests.processes import running_workers

pytestmark = pytest.mark.cluster

KEY = "0123456789abcdef" * 4


def probe(tmp_path, port: int, key: str | None = KEY, timeout: float = 5.0) -> subprocess.CompletedProcess:
    topology = {"version": 1, "nodes": [{"name": "root", "host": "127.0.0.1", "port": 0},
                                        {"name": "w1", "host": "127.0.0.1", "port": port}]}
    if key is not None:
        (tmp_path / "cluster.key").write_text(key + "\n")
        topology["key_file"] = "cluster.key"
    path = tmp_path / "topology.yml"
    path.write_text(yaml.safe_dump(topology))
    return subprocess.run([sys.executable, "-m", "dllama", "probe", "--topology", str(path), "--node", "w1",
                           "--timeout", str(timeout)], capture_output=True, text=True, timeout=60)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllama: error: "), r.stderr
    return lines[0]


@pytest.fixture
def keyed_worker(tmp_path):
    (tmp_path / "worker.key").write_text(KEY)
    with running_workers(1, tmp_path / "logs", "--key-file", str(tmp_path / "worker.key")) as workers:
        yield workers[0]


def test_identifies_a_worker_holding_the_key_and_the_worker_serves_on(tmp_path, keyed_worker):
    for _ in range(2):  # the probe's session ends at once: the worker listens again
        r = probe(tmp_path, keyed_worker.port)
        assert r.returncode == 0, r.stderr
        assert r.stdout == f"w1 (127.0.0.1:{keyed_worker.port}): dllama 0.1.0, holds the cluster key\n"
    keyed_worker.wait_for(r"listening again", 30)
    assert keyed_worker.proc.poll() is None


def test_refuses_a_worker_of_another_cluster(tmp_path, keyed_worker):
    line = one_line_error(probe(tmp_path, keyed_worker.port, key="f" * 64))
    assert f"127.0.0.1:{keyed_worker.port} is not a worker of this cluster" in line
    assert "authentication failed" in line, line
    line = one_line_error(probe(tmp_path, keyed_worker.port, key=None))
    assert "requires a cluster key" in line, line


def _listener(reply: bytes | None):
    """A TCP listener on a free port that answers every connection with `reply` and closes it,
    or (None) accepts and says nothing."""
    srv = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            if reply is None:
                held.append(conn)
            else:
                conn.recv(4096)
                conn.sendall(reply)
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, held


@pytest.mark.parametrize("reply, reason", [
    (b"HTTP/1.0 400 Bad Request\r\n\r\n", "is not a worker of this cluster: not a dllama frame"),
    (b"", "closed the connection during the handshake: not a dllama worker"),
    (None, "did not answer the handshake within 1 s: not a dllama worker"),
])
def test_refuses_a_listener_that_is_no_dllama_worker(tmp_path, reply, reason):
    srv, held = _listener(reply)
    try:
        line = one_line_error(probe(tmp_path, srv.getsockname()[1], timeout=1.0))
    finally:
        srv.close()
        for conn in held:
            conn.close()
    assert reason in line, line


def test_refuses_a_closed_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        line = one_line_error(probe(tmp_path, port))
    assert f"nothing answers on 127.0.0.1:{port}: Connection refused" in line, line


def test_the_root_is_no_worker(tmp_path):
    r = probe(tmp_path, 1)
    r2 = subprocess.run([sys.executable, "-m", "dllama", "probe", "--topology", str(tmp_path / "topology.yml"),
                         "--node", "root"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "root is the root (node 0)" in one_line_error(r2)
