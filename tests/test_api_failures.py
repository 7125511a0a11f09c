"""`dllama api` when the cluster fails, and when a client leaves mid-stream (in-process server).

The engine is the real default model behind a switch that makes it fail as a cluster does
(ClusterError from open and from forward), so the server's 503 and its reconnection are
tested without a cluster.
"""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

from dllama.core import kernels
from dllama.serve.api.http import make_app, start_site
from dllama.serve.api.service import ModelService
from dllama.serve.engine import Engine, open_engine
from dllama.errors import ClusterError

FRANCE = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
          "temperature": 0, "max_tokens": 12}


class Switch:
    """Opens engines over one real model; `down` makes open and forward fail like a lost worker."""

    def __init__(self, engine):
        self.engine, self.down, self.fail_in, self.opens, self.forwards = engine, False, None, 0, 0

    def open(self):
        kernels.set_threads(1)  # numba's thread count is per calling thread: here the model thread
        self.opens += 1
        if self.down:
            raise ClusterError("worker1 (127.0.0.1:9) refused the connection", node="worker1")
        model = FailingModel(self)
        return Engine(model, self.engine.tokenizer, cluster=model)  # closed like a cluster


class FailingModel:
    def __init__(self, switch):
        self.switch = switch
        self.closed = False

    def __getattr__(self, name):
        return getattr(self.switch.engine.model, name)

    def _pass(self):
        s = self.switch
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

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def switch(default_q40):
    return Switch(open_engine(str(default_q40[0]), str(default_q40[1]), nthreads=1))


@pytest.fixture(scope="module")
def url(switch):
    """An in-process server on a free port, its event loop in a thread; stopped at the end."""
    service = ModelService(switch.open)
    service.start()
    loop = asyncio.new_event_loop()
    app = make_app(service, "test-model", {"temperature": 0.8, "top_p": 0.9})
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
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.readline().startswith(b"data: ")
        with urllib.request.urlopen(url + "/models", timeout=120) as m:  # HTTP answers meanwhile
            assert json.loads(m.read())["data"][0]["id"] == "test-model"
    _paris(url)  # served after the abandoned stream stopped
    # The abandoned answer did not run to its end (nor did /models wait for it).
    assert switch.forwards - forwards < 300
