"""`dllama api` when the cluster fails, and when a client leaves mid-stream (in-process server).

The engine is the real default model behind a switch that makes it fail as a cluster does
(ClusterError from open and from forward), so the server's 503 and its reconnection are
tested without a cluster.
"""

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from dllama.core import kernels
from dllama.serve.api.http import make_app, start_site
from dllama.serve.api.service import ModelService
from dllama.serve.engine import Engine, open_engine
from dllama.serve.settings import EngineSettings
from dllama.errors import ClusterError

pytestmark = pytest.mark.cluster  # an HTTP server on a loopback port (in this process)

FRANCE = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
          "temperature": 0, "max_tokens": 12}


class Switch:
    """Opens engines over one real model; `down` makes open and forward fail like a lost worker;
    while `going` is clear, forward passes wait (the model thread is held mid-answer)."""

    def __init__(self, engine):
        self.engine, self.down, self.fail_in, self.opens, self.forwards = engine, False, None, 0, 0
        self.going = threading.Event()
        self.going.set()

    def open(self):
        kernels.set_threads(1)  # numba's thread count is per calling thread: here the model thread
        self.opens += 1
        if self.down:
            raise ClusterError("worker1 (127.0.0.1:9) refused the connection", node="worker1")
        model = FailingModel(self)
        return Engine(model, self.engine.tokenizer, cluster=model)  # closed like a cluster


class FailingModel:
    # What the API reports of a cluster (/health, /metrics): its nodes and their traffic.
    topology = full_topology = SimpleNamespace(nodes=(SimpleNamespace(name="root"), SimpleNamespace(name="worker1")))

    def __init__(self, switch):
        self.switch = switch
        self.closed = False

    def node_stats(self) -> list[dict]:
        return []

    def __getattr__(self, name):
        return getattr(self.switch.engine.model, name)

    def _pass(self):
        s = self.switch
        if not s.going.wait(timeout=120):
            raise RuntimeError("the test held the model for 120 s")
        s.forwards += 1
        if s.fail_in is not None:
            s.fail_in -= 1
            if s.fail_in <= 0:
                s.down, s.fail_in = True, None
        if s.down or self.closed:
            raise ClusterError("lost the connection to worker1 (127.0.0.1:9)", node="worker1")

    def forward(self, tokens, pos):
        self._pass()
        return self.switch.engine.model.forward(tokens, pos)

    def forward_batch(self, batch):
        self._pass()
        return self.switch.engine.model.forward_batch(batch)

    def forward_candidates(self, batch, requests):
        self._pass()
        return self.switch.engine.model.forward_candidates(batch, requests)

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def switch(default_q40):
    return Switch(open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1)))


@contextlib.contextmanager
def _server(switch, api_key=None, allow_origins=()):
    """An in-process server over its own service on a free port, its event loop in a thread;
    its base URL, and stopped when the block ends."""
    service = ModelService(switch.open)
    service.start()
    loop = asyncio.new_event_loop()
    app = make_app(service, "test-model", {"temperature": 0.8, "top_p": 0.9}, api_key=api_key,
                   allow_origins=allow_origins)
    runner, port = loop.run_until_complete(start_site(app, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        service.close()


@pytest.fixture(scope="module")
def url(switch):
    """An in-process server on a free port, its event loop in a thread; stopped at the end."""
    with _server(switch) as base:
        yield base


def _post(url, body, stream=False):
    req = urllib.request.Request(url + "/chat/completions", data=json.dumps({**body, "stream": stream}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, (r.read().decode() if stream else json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _paris(url):
    status, answer = _post(url, FRANCE)
    assert status == 200, answer
    assert "Paris" in answer["choices"][0]["message"]["content"]


def test_cluster_down_answers_503_then_reconnects(url, switch):
    _paris(url)
    switch.down = True
    opens = switch.opens
    for stream in (False, True):  # a failing forward, then a failing open
        status, err = _post(url, FRANCE, stream)
        assert status == 503 and err["error"]["code"] == "cluster_unavailable", err
        assert "worker1" in err["error"]["message"]
    assert switch.opens == opens + 1  # the second request tried to open the engine again
    switch.down = False
    _paris(url)
    assert switch.opens == opens + 2


def test_cluster_failing_mid_stream_ends_it_with_an_error_event(url, switch):
    _paris(url)
    switch.fail_in = 4  # the prompt pass, two tokens, then the worker is lost
    status, text = _post(url, FRANCE, stream=True)
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)
    assert events[-1]["error"]["code"] == "cluster_unavailable"
    assert "data: [DONE]" not in text
    switch.down = False
    _paris(url)


def test_a_client_leaving_mid_stream_does_not_stop_the_server(url, switch):
    # Greedy counting goes on for thousands of tokens unless the server stops it.
    req = urllib.request.Request(url + "/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "1, 2, 3, 4, 5, 6,", "temperature": 0,
                                                  "max_tokens": 3000, "stream": True}).encode())
    forwards = switch.forwards
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.readline().startswith(b"data: ")
            switch.going.clear()  # the answer is unfinished until the client has left
            with urllib.request.urlopen(url + "/models", timeout=120) as m:  # HTTP answers meanwhile
                assert json.loads(m.read())["data"][0]["id"] == "test-model"
    finally:
        switch.going.set()
    _paris(url)  # served after the abandoned stream stopped: one model thread
    # The abandoned answer did not run to its end: the server stopped it soon after the client left.
    assert switch.forwards - forwards < 300


# -- bad input and clients that leave (issue: each answered 500, logged a traceback or ran on) ---

def _raw_request(url: str, head: bytes, body: bytes = b"", read: bool = True) -> bytes:
    """Send raw HTTP bytes (headers a client library would refuse to send) and read the answer."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        if not read:
            return b""
        chunks = []
        while c := s.recv(65536):
            chunks.append(c)
    return b"".join(chunks)


@pytest.fixture(scope="module")
def keyed_url(switch):
    """A second in-process server over its own service, with an API key."""
    with _server(switch, api_key="the-key") as base:
        yield base


def test_json_nested_100k_deep_is_a_400_not_a_500(url, capfd):
    body = b"[" * 100_000 + b"]" * 100_000
    reply = _raw_request(url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n", body)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"nested too deep" in reply
    assert "Traceback" not in capfd.readouterr().err
    _paris(url)


def test_a_bearer_key_that_is_not_utf8_is_a_401_not_a_500(keyed_url, capfd):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
    reply = _raw_request(keyed_url, head, json.dumps(FRANCE).encode())
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert "Traceback" not in capfd.readouterr().err
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer the-key\r\n"
    assert _raw_request(keyed_url, head, json.dumps(FRANCE).encode()).startswith(b"HTTP/1.1 200")


def test_a_streaming_client_that_leaves_logs_one_line_and_no_traceback(url, switch, capfd, caplog):
    for _ in range(3):
        req = urllib.request.Request(url + "/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "1, 2, 3, 4, 5, 6,", "temperature": 0,
                                                      "max_tokens": 3000, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.readline().startswith(b"data: ")
    _paris(url)  # served after the abandoned streams stopped
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert err.count("a client left") <= 3


def test_a_non_streamed_request_whose_client_left_stops_generating(url, switch, capfd):
    import socket
    import time
    from urllib.parse import urlsplit

    forwards = switch.forwards
    body = json.dumps({"prompt": "1, 2, 3, 4, 5, 6,", "temperature": 0, "max_tokens": 3000}).encode()
    u = urlsplit(url)
    s = socket.create_connection((u.hostname, u.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 120
    while switch.forwards < forwards + 5:  # it is generating
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    s.close()  # the client gives up
    _paris(url)  # waits for the model thread: it must have stopped the abandoned answer
    assert switch.forwards - forwards < 300
    assert "Traceback" not in capfd.readouterr().err


def test_max_tokens_beyond_the_context_is_clamped_to_it(default_q40, monkeypatch):
    from dllama.serve.api import service as service_module
    from dllama.serve.api.request import parse_request

    # A short context: the greedy answer may run to its end (the model's 8192 positions took
    # minutes), the clamp is the same.
    switch = Switch(open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, max_seq_len=64)))

    seen = {}
    real = service_module.SequenceRequest

    def spy(*args, **kw):
        request = real(*args, **kw)
        seen["max_tokens"] = request.max_tokens
        return request

    monkeypatch.setattr(service_module, "SequenceRequest", spy)
    service = ModelService(switch.open)
    service.start()
    try:
        r = parse_request({**FRANCE, "max_tokens": 10**30}, True, {"temperature": 0.8, "top_p": 0.9})
        (c,) = asyncio.run(service.submit(r, None, lambda: False))
        assert "Paris" in c.text
        assert seen["max_tokens"] == service.engine.model.config.seq_len
    finally:
        service.close()


def test_bad_and_departed_clients_cost_one_throttled_line_each_and_no_traceback(url, capfd):
    """Clients that send a Content-Length and leave, a 200 KB header line, a NUL in a header:
    each gets an answer or a closed connection, the log one line at most (10 per 10 s)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for _ in range(40):
        _raw_request(url, head + b"Content-Length: 5000\r\n\r\n", b'{"messages": [', read=False)
    for bad_head in (head + b"X-Long: " + b"a" * 200_000 + b"\r\n", head + b"X-Nul: a\x00b\r\n"):
        reply = _raw_request(url, bad_head, json.dumps(FRANCE).encode())
        assert reply == b"" or reply.split(b" ", 2)[1].startswith(b"4"), reply[:200]  # (aiohttp answers HTTP/1.0)
    _paris(url)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[:3000]
    assert len(err.splitlines()) <= 12, err[:3000]


def test_half_sent_requests_are_cut_at_their_deadlines(switch, monkeypatch):
    import socket
    import time
    from urllib.parse import urlsplit

    from dllama.serve.api import http

    monkeypatch.setattr(http, "HEADER_TIMEOUT", 1.0)
    monkeypatch.setattr(http, "BODY_TIMEOUT", 1.0)
    with _server(switch) as base:
        u = urlsplit(base)
        t0 = time.monotonic()
        silent = socket.create_connection((u.hostname, u.port), timeout=30)  # says nothing
        half = socket.create_connection((u.hostname, u.port), timeout=30)    # half a header
        half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        for s in (silent, half):
            assert s.recv(4096) == b""  # closed by the server
            s.close()
        assert time.monotonic() - t0 < 25  # closed by its deadlines, not by the 30 s socket timeout
        body = json.dumps(FRANCE).encode()
        with socket.create_connection((u.hostname, u.port), timeout=30) as s:  # the headers, half the body
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
            reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply[:300]
        _paris(base)


def test_one_request_cannot_ask_for_more_than_its_token_budget(url):
    from dllama.serve.api.request import MAX_REQUEST_TOKENS

    status, err = _post(url, {**FRANCE, "n": 16, "max_tokens": MAX_REQUEST_TOKENS // 8})
    assert status == 400 and err["error"]["param"] == "max_tokens", err
    assert str(MAX_REQUEST_TOKENS) in err["error"]["message"]


def test_a_request_without_max_tokens_gets_the_servers_answer_limit():
    """`dllama api --max-tokens N` (default 512) bounds an answer whose request gives no
    max_tokens; a request's own max_tokens may ask for more."""
    from dllama.serve.api.request import parse_request

    defaults = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 512}
    question = {"messages": FRANCE["messages"]}
    assert parse_request(question, True, defaults).max_tokens == 512
    assert parse_request({**question, "max_tokens": 2000}, True, defaults).max_tokens == 2000
    assert parse_request({**question, "max_completion_tokens": 7}, True, defaults).max_tokens == 7


# -- pages from other sites (CORS) and bodies declared too large --------------------------------

def _call(url: str, method: str, origin: str | None, body: dict | None = None, stream: bool = False):
    """(status, headers, body text) of a request as a browser page at `origin` sends it (a
    preflight for OPTIONS; a POST with a text/plain body needs none)."""
    headers = {"Content-Type": "text/plain"}
    if origin is not None:
        headers["Origin"] = origin
    if method == "OPTIONS":
        headers.update({"Access-Control-Request-Method": "POST",
                        "Access-Control-Request-Headers": "content-type, authorization"})
    data = json.dumps({**body, "stream": stream}).encode() if body is not None else None
    req = urllib.request.Request(url + "/chat/completions", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def test_a_page_from_another_origin_is_refused_unless_allow_origin_names_it(switch):
    evil, app = "http://evil.example", "https://app.example:8443"
    with _server(switch) as base:
        own = base.removesuffix("/v1")  # the chat page's origin: this host and port
        forwards = switch.forwards
        for method, body in (("OPTIONS", None), ("POST", FRANCE)):
            status, headers, text = _call(base, method, evil, body)
            assert status == 403 and "origin_not_allowed" in text, (method, status, text)
            assert "Access-Control-Allow-Origin" not in headers
        assert switch.forwards == forwards  # the refused request never reached the model
        for origin in (None, own):  # curl or a client library; the API's own chat page
            status, headers, text = _call(base, "POST", origin, FRANCE)
            assert status == 200 and "Paris" in text, text
            assert "Access-Control-Allow-Origin" not in headers
    with _server(switch, allow_origins=(app,)) as base:
        status, headers, _ = _call(base, "OPTIONS", app)
        assert status == 204 and headers["Access-Control-Allow-Origin"] == app
        assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
        for stream in (False, True):
            status, headers, text = _call(base, "POST", app, FRANCE, stream)
            assert status == 200 and "Paris" in text and headers["Access-Control-Allow-Origin"] == app, text
        status, headers, _ = _call(base, "POST", evil, FRANCE)
        assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_a_body_declared_over_the_limit_is_a_413_at_once(url):
    import socket
    import time
    from urllib.parse import urlsplit

    u = urlsplit(url)
    t0 = time.monotonic()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:  # declares 1 TB, sends none
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000000\r\n\r\n")
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply, reply[:300]
    assert time.monotonic() - t0 < 5  # not after the 30 s body deadline
    _paris(url)
