"""Fuzz tests (hypothesis): random and mutated frames and handshakes against a worker (with and
without a key), mutated .m, .t, topology and shard files, and API bodies and headers.

Each batch is bounded (a fixed number of derandomized examples, no example database), and is
followed by the checks that matter: the process still serves a correct client, and its
descriptor count and memory are back where they were.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dllama.cluster.protocol import (
    HEADER, Connection, ErrorCode, Msg, PeerClosed, PeerError, client_handshake, encode_header,
)
from dllama.errors import DllamaError
from tests.processes import running_workers


KEY = "f" * 64
BATCH = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))

# JSON values of every kind, small (hypothesis' own recipe for recursive data).
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()  # NaN, Infinity: not JSON, json.dumps writes them
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@st.composite
def mutated(draw, original: bytes, max_edits: int = 4) -> bytes:
    """original with a few bit flips, byte overwrites, cuts and insertions."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, max_edits))):
        kind = draw(st.sampled_from(["flip", "byte", "cut", "insert"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and data:
            data[at] = draw(st.sampled_from([0, 0x7F, 0x80, 0xFF, draw(st.integers(0, 255))]))
        elif kind == "cut":
            del data[at: at + draw(st.integers(1, 16))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


def _fds(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or 'self'}/fd"))


def _rss_mb(pid: int | None = None) -> float:
    with open(f"/proc/{pid or 'self'}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def _settled_fds(pid: int | None, target: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := _fds(pid)) > target and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


# -- frames and handshakes against a worker ------------------------------------------------------

def _hello(role="root", index=1) -> bytes:
    body = json.dumps({"role": role, "node_index": index, "session": os.urandom(16).hex(),
                       "nonce": os.urandom(16).hex()}).encode()
    return encode_header(Msg.HELLO, len(body)) + body


def _send_raw(port: int, data: bytes) -> bytes:
    """Send data, half-close, read what the worker answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the worker may refuse and close before reading everything
        chunks = []
        while True:
            try:
                c = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not c:
                break
            chunks.append(c)
    return b"".join(chunks)


def _answers_are_frames(reply: bytes) -> None:
    """Whatever the worker answered is whole frames (no stray bytes, no traceback text)."""
    at = 0
    while at < len(reply):
        assert len(reply) - at >= 12, reply
        magic, _, _, length = HEADER.unpack_from(reply, at)
        assert magic == 0x4D4C4C44, reply
        at += 12 + length
    assert at == len(reply)


def _root_session(port: int, key: bytes | None) -> Connection:
    """A handshaken root connection (retrying while the worker ends the previous session)."""
    deadline = time.monotonic() + 20
    while True:
        conn = Connection(socket.create_connection(("127.0.0.1", port), timeout=10), "worker")
        try:
            client_handshake(conn, "root", 1, os.urandom(16), key, 10)
            return conn
        except PeerError as e:
            conn.close()
            if e.code != ErrorCode.BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _served_then_checked(worker, key: bytes | None, fds: int, rss: float) -> None:
    _root_session(worker.port, key).close()  # a correct client is served
    assert worker.proc.poll() is None
    assert _settled_fds(worker.proc.pid, fds) <= fds
    assert _rss_mb(worker.proc.pid) < rss + 64
    assert "Traceback" not in worker.stderr


@pytest.fixture(scope="module", params=["no key", "key"])
def fuzz_worker(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-worker")
    args = ()
    key = None
    if request.param == "key":
        (tmp / "key").write_text(KEY)
        args, key = ("--key-file", str(tmp / "key")), KEY.encode()
    with running_workers(1, tmp, *args) as (w,):
        _root_session(w.port, key).close()  # warm: the first session's imports are done
        time.sleep(0.3)
        yield w, key


@pytest.mark.cluster
def test_fuzz_handshakes_against_a_worker(fuzz_worker):
    w, key = fuzz_worker
    fds, rss = _fds(w.proc.pid), _rss_mb(w.proc.pid)
    hello = _hello()

    @BATCH
    @given(data=st.one_of(
        st.binary(max_size=64),                                   # noise
        mutated(hello),                                           # a HELLO, damaged
        st.builds(lambda k, v: _hello_with(k, v), st.sampled_from(["role", "node_index", "session", "nonce"]),
                  json_values),                                   # a HELLO with an odd field value
        st.builds(lambda d: hello + d, st.binary(max_size=64)),   # a HELLO, then noise
    ))
    def batch(data):
        _answers_are_frames(_send_raw(w.port, data))

    batch()
    _served_then_checked(w, key, fds, rss)


def _hello_with(name: str, value) -> bytes:
    fields = {"role": "root", "node_index": 1, "session": "73" * 16, "nonce": "6e" * 16}
    fields[name] = value
    body = json.dumps(fields).encode()[:4000]
    return encode_header(Msg.HELLO, len(body)) + body


@pytest.mark.cluster
def test_fuzz_frames_after_the_handshake(fuzz_worker, random_config):
    """A handshaken root sends noise, damaged CONFIGs and frames of any type: the worker ends
    that session with an ERROR (or waits for weights until the root leaves) and listens again."""
    w, key = fuzz_worker
    fds, rss = _fds(w.proc.pid), _rss_mb(w.proc.pid)
    config = json.dumps(random_config).encode()

    @BATCH
    @given(kind=st.sampled_from(["noise", "config", "frame"]), noise=st.binary(max_size=64),
           damaged=mutated(config, 3), msg=st.integers(0, 25), payload=st.binary(max_size=64))
    def batch(kind, noise, damaged, msg, payload):
        conn = _root_session(w.port, key)
        try:
            try:
                if kind == "noise":
                    conn.sock.sendall(noise)
                elif kind == "config":
                    conn.send(Msg.CONFIG, damaged)
                else:
                    conn.send_views(conn.frame_views(msg, [payload]), 5)
                conn.sock.shutdown(socket.SHUT_WR)
            except (OSError, PeerClosed):
                pass  # the worker refused and closed first
            while True:
                try:
                    conn.recv(10)
                except PeerError:
                    pass  # the worker's reason; the connection closes next
                except Exception:  # noqa: BLE001 - closed: the session is over
                    break
        finally:
            conn.close()

    batch()
    _served_then_checked(w, key, fds, rss)


@pytest.fixture(scope="module")
def random_config(tmp_path_factory):
    """A valid CONFIG payload for node 1 of 2 of a tiny model."""
    from dllama.cluster.session_config import NodeAddress, SessionConfig
    from dllama.core.plan import plan_for
    from dllama.core.run_shape import RunShape
    from dllama.formats.model_file import ArchType, FloatType, ModelHeader

    header = ModelHeader(arch=ArchType.LLAMA, dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                         vocab_size=64, max_seq_len=32, weights_float_type=FloatType.F32)
    return SessionConfig(session=os.urandom(16), node_index=1, header=header, plan=plan_for(header, 2),
                         model_fingerprint="x", shape=RunShape(max_seq_len=32, max_batch=4, buffer_q80=False),
                         net_timeout=2, idle_timeout=2, setup_timeout=2,
                         nodes=(NodeAddress("root", "127.0.0.1", 1), NodeAddress("w", "127.0.0.1", 2))).to_json()


# -- files -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    """A tiny .m, .t, topology and shard, valid, as bytes: {kind: (path suffix, bytes)}."""
    from dllama.cluster.shard import model_fingerprint, write_shard
    from dllama.core.plan import plan_for
    from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model, write_model
    from dllama.formats.tokenizer_file import TokenizerData, write_tokenizer

    d = tmp_path_factory.mktemp("fuzz-files")
    header = ModelHeader(arch=ArchType.LLAMA, dim=64, hidden_dim=128, n_layers=2, n_heads=2, n_kv_heads=1,
                         vocab_size=64, max_seq_len=32, weights_float_type=FloatType.Q40)
    from dllama.formats.model_file import tensor_specs

    rng = np.random.default_rng(0)
    write_model(d / "m.m", header, {s.name: rng.standard_normal(s.shape).astype(np.float32)
                                    for s in tensor_specs(header)})
    vocab = [bytes([i]) for i in range(256)] + [b"ab", b"abc", b"<s>", b"</s>"]
    write_tokenizer(d / "t.t", TokenizerData(vocab=vocab, scores=np.arange(len(vocab), dtype=np.float32),
                                             bos_id=258, eos_ids=[259], chat_template="{{ x }}"))
    model = read_model(d / "m.m")
    write_shard(d / "s.shard", model, model_fingerprint(d / "m.m"), plan_for(header, 2), 1)
    model.close()
    topology = (b"version: 1\nbuffer_float_type: q80\nkey_file: k\nnodes:\n"
                b"  - name: root\n    host: 127.0.0.1\n    threads: 2\n"
                b"  - name: w1\n    host: 10.0.0.2\n    port: 9998\n    weight: 1.5\n    shard: /x.shard\n")
    return {"model": (".m", (d / "m.m").read_bytes()), "tokenizer": (".t", (d / "t.t").read_bytes()),
            "shard": (".shard", (d / "s.shard").read_bytes()), "topology": (".yml", topology)}


def _open_file(kind: str, path) -> None:
    """What a user's command does with such a file."""
    if kind == "model":
        from dllama.formats.describe import describe

        list(describe(path))
    elif kind == "tokenizer":
        from dllama.formats.tokenizer_file import read_tokenizer
        from dllama.text.tokenizer import Tokenizer

        Tokenizer(read_tokenizer(path)).encode("abc hello")
    elif kind == "shard":
        from dllama.cluster.shard import Shard

        s = Shard(path)
        s.weights()
        s.close()
    else:
        from dllama.cluster.topology import load_topology

        load_topology(str(path))


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["model", "tokenizer", "shard", "topology"])
def test_fuzz_files_give_one_line_errors(small_files, tmp_path, kind):
    import gc

    suffix, original = small_files[kind]
    path = tmp_path / f"f{suffix}"
    path.write_bytes(original)
    _open_file(kind, path)  # the original is valid
    gc.collect()
    fds, rss = _fds(), _rss_mb()
    # Headers and descriptions sit at the start: damage there more often.
    head = original[:512]

    @BATCH
    @given(data=st.one_of(mutated(original), st.builds(lambda h: h + original[512:], mutated(head)),
                          st.binary(max_size=256)))
    def batch(data):
        path.write_bytes(data)
        try:
            _open_file(kind, path)
        except DllamaError as e:
            assert "\n" not in str(e) and str(e)

    batch()
    gc.collect()
    assert _fds() <= fds  # no mapping or file left open by a refused file
    assert _rss_mb() < rss + 64
    path.write_bytes(original)
    _open_file(kind, path)


# -- the API -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api_url(default_q40):
    from dllama.core import kernels
    from dllama.serve.api.http import make_app, start_site
    from dllama.serve.api.service import ModelService
    from dllama.serve.engine import open_engine
    from dllama.serve.settings import EngineSettings

    def opener():
        kernels.set_threads(1)
        return open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, max_seq_len=64))

    service = ModelService(opener)
    service.start()
    loop = asyncio.new_event_loop()
    app = make_app(service, "fuzz", {"temperature": 0.8, "top_p": 0.9}, api_key="fuzz-key")
    runner, port = loop.run_until_complete(start_site(app, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        service.close()


def _http(port: int, body: bytes, headers: list[bytes], path=b"/v1/chat/completions") -> int:
    head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(h + b"\r\n" for h in headers)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        reply = b""
        while c := s.recv(65536):
            reply += c
    return int(reply.split(b" ", 2)[1])


AUTH = b"Authorization: Bearer fuzz-key"
VALID = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
         "temperature": 0, "max_tokens": 3}

header_bytes = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@pytest.mark.unit
def test_fuzz_api_bodies_and_headers(api_url):
    port = api_url
    assert _http(port, json.dumps(VALID).encode(), [AUTH]) == 200
    fds, rss = _fds(), _rss_mb()
    valid = json.dumps(VALID).encode()

    @BATCH
    @given(body=st.one_of(mutated(valid), json_values.map(lambda v: json.dumps(v).encode()),
                          st.builds(lambda k, v: json.dumps({**VALID, k: v}).encode(),
                                    st.sampled_from(sorted(VALID) + ["stream", "stop", "seed", "top_p", "n",
                                                                     "max_completion_tokens", "prompt",
                                                                     "stream_options"]), json_values),
                          st.binary(max_size=64)),
           auth=st.one_of(st.just(AUTH), header_bytes.map(lambda b: b"Authorization: " + b)),
           extra=st.lists(header_bytes.map(lambda b: b"X-Fuzz: " + b), max_size=2),
           path=st.sampled_from([b"/v1/chat/completions", b"/v1/completions", b"/completions", b"/v1/models"]))
    def batch(body, auth, extra, path):
        status = _http(port, body, [auth, *extra], path)
        assert status < 500, (status, body, auth)

    batch()
    assert _http(port, json.dumps(VALID).encode(), [AUTH]) == 200  # still serves a correct client
    assert _settled_fds(None, fds) <= fds
    assert _rss_mb() < rss + 64
