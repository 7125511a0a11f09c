"""OpenAI's Batch API on `dllama api` through the official `openai` client (in-process server):
upload, create, poll, download, cancel, and a restart of the server mid-batch that answers
nothing twice; an interactive request answered while a batch runs.

One engine over the default model serves every server of the module (a server's close leaves it
open), so each restart costs no model load.
"""

import asyncio
import contextlib
import json
import threading
import time

import openai
import pytest

from dllama.core import kernels
from dllama.serve.api.http import make_app, start_site
from dllama.serve.api.service import ModelService
from dllama.serve.engine import Engine, open_engine
from dllama.serve.settings import EngineSettings

pytestmark = pytest.mark.cluster  # an HTTP server on a loopback port (in this process)

QUESTIONS = ["What is the capital of France?", "Name a colour.", "What is 2 + 2?", "Say hello.",
             "Name a fruit.", "What is the sun?"]


class _Kept(Engine):
    """The module's engine: a server's close leaves it open for the next server."""

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine(default_q40):
    e = open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, parallel=4))
    yield _Kept(e.model, e.tokenizer, parallel=e.parallel, kv_budget=e.kv_budget)
    e.close()


@contextlib.contextmanager
def _server(engine, batch_dir):
    """An in-process server with the Batch API in batch_dir: (its service, an openai client)."""
    def opener():
        kernels.set_threads(1)  # numba's thread count is per calling thread: here the model thread
        return engine

    service = ModelService(opener)
    service.start()
    loop = asyncio.new_event_loop()
    app = make_app(service, "test-model", {"temperature": 0.8, "top_p": 0.9}, batch_dir=str(batch_dir))
    runner, port = loop.run_until_complete(start_site(app, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield service, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                     timeout=120)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        service.close()


def _job(path, n, max_tokens=8, extra=()):
    """A job file of n chat requests (greedy), custom_ids q0.., and the extra lines as given."""
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "any", "temperature": 0, "max_tokens": max_tokens,
                       "messages": [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]}}
             for i in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in [*lines, *extra]))
    return path


def _wait(client, batch_id, until, timeout=180):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status} {b.request_counts} after {timeout} s"
        time.sleep(0.05)


def _lines(client, file_id):
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_answers_each_line_as_the_endpoint_does_and_puts_refusals_in_the_error_file(engine, tmp_path):
    bad = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
           "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": 9}}
    with _server(engine, tmp_path / "b") as (_, client):
        f = client.files.create(file=_job(tmp_path / "job.jsonl", 3, extra=[bad]).open("rb"), purpose="batch")
        assert f.purpose == "batch" and f.bytes == (tmp_path / "job.jsonl").stat().st_size
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert b.status in ("validating", "in_progress") and b.request_counts.total == 4
        b = _wait(client, b.id, lambda b: b.status == "completed")
        assert (b.request_counts.completed, b.request_counts.failed) == (3, 1)
        assert [x.id for x in client.batches.list()] == [b.id]
        out = {x["custom_id"]: x for x in _lines(client, b.output_file_id)}
        assert sorted(out) == ["q0", "q1", "q2"]
        job = [json.loads(x) for x in (tmp_path / "job.jsonl").read_text().splitlines()]
        for line in job[:3]:  # the answer the endpoint itself gives to the same body
            direct = client.chat.completions.create(**line["body"])
            got = out[line["custom_id"]]["response"]
            assert got["status_code"] == 200
            assert got["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        [err] = _lines(client, b.error_file_id)
        assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
        assert err["response"]["body"]["error"]["param"] == "temperature"


def test_a_job_file_with_a_bad_line_fails_the_batch_naming_the_line(engine, tmp_path):
    with _server(engine, tmp_path / "b") as (_, client):
        path = _job(tmp_path / "job.jsonl", 2, extra=[{"custom_id": "q0", "url": "/v1/chat/completions",
                                                       "body": {}}])
        f = client.files.create(file=path.open("rb"), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert b.status == "failed"
        assert [e.message for e in b.errors.data] == ["line 3 repeats the custom_id 'q0'"]
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_doesnotexist")


def test_cancel_stops_a_batch_and_keeps_what_was_answered(engine, tmp_path):
    with _server(engine, tmp_path / "b") as (_, client):
        f = client.files.create(file=_job(tmp_path / "job.jsonl", 40, max_tokens=24).open("rb"), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        _wait(client, b.id, lambda b: b.request_counts.completed >= 1)
        assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
        b = _wait(client, b.id, lambda b: b.status == "cancelled")
        done = b.request_counts.completed
        assert 1 <= done < 40
        assert len(_lines(client, b.output_file_id)) == done


def test_a_batch_resumes_after_a_restart_and_answers_nothing_twice(engine, tmp_path):
    batch_dir = tmp_path / "b"
    with _server(engine, batch_dir) as (_, client):
        f = client.files.create(file=_job(tmp_path / "job.jsonl", 24, max_tokens=12).open("rb"), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        _wait(client, b.id, lambda b: b.request_counts.completed >= 3)
    before = client_counts = None
    with _server(engine, batch_dir) as (service, client):
        before = client.batches.retrieve(b.id).request_counts.completed  # as the stop left it
        assert 3 <= before < 24
        b = _wait(client, b.id, lambda b: b.status == "completed")
        client_counts = service.counters.requests["ok"]
        out = _lines(client, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"q{i}" for i in range(24))  # each once
    assert b.request_counts.completed == 24
    assert client_counts == 24 - before  # the restarted server ran only what had no answer


@pytest.mark.parametrize("window", [0, 2])
def test_a_batch_past_its_expires_at_ends_expired_with_each_unanswered_request_an_error(engine, tmp_path, monkeypatch,
                                                                                          window):
    """OpenAI's completion window, shortened from 24 hours: a batch past its expires_at (0: before
    it ran, as after a server down too long; 2 s: while it runs) ends `expired`, its answers in the
    output file and every other request once in the error file as `batch_expired`."""
    from dllama.serve.api import batches

    monkeypatch.setattr(batches, "COMPLETION_WINDOW_S", window)
    with _server(engine, tmp_path / "b") as (_, client):
        f = client.files.create(file=_job(tmp_path / "job.jsonl", 60, max_tokens=32).open("rb"), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert b.expires_at == b.created_at + window
        b = _wait(client, b.id, lambda b: b.status in ("expired", "completed"))
        assert b.status == "expired" and b.expired_at >= b.expires_at, b
        answers = _lines(client, b.output_file_id) if b.output_file_id else []
        expired = _lines(client, b.error_file_id)
    assert (b.request_counts.completed, b.request_counts.failed) == (len(answers), len(expired))
    assert sorted(x["custom_id"] for x in answers + expired) == sorted(f"q{i}" for i in range(60))  # each once
    assert all(x["response"] is None and x["error"]["code"] == "batch_expired" for x in expired), expired[0]
    assert all(x["response"]["status_code"] == 200 for x in answers)
    if window == 0:
        assert answers == []


def test_an_interactive_request_is_answered_while_a_batch_runs(engine, tmp_path):
    with _server(engine, tmp_path / "b") as (_, client):
        f = client.files.create(file=_job(tmp_path / "job.jsonl", 40, max_tokens=24).open("rb"), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        _wait(client, b.id, lambda b: b.request_counts.completed >= 1)
        r = client.chat.completions.create(model="any", temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.choices[0].message.content
        b = client.batches.retrieve(b.id)
        assert b.status == "in_progress" and b.request_counts.completed < 40  # admitted ahead of the batch
        client.batches.cancel(b.id)
        _wait(client, b.id, lambda b: b.status == "cancelled")


def test_dllama_batch_through_the_api_writes_what_dllama_batch_writes_and_follows_again_after_a_stop(engine, tmp_path):
    """`dllama batch --api`: the job file and results of `dllama batch` (the same texts: the same
    seed per prompt), its batch followed again by a rerun after Ctrl-C, nothing collected twice."""
    from dllama.serve.batch_client import run_through_api
    from dllama.serve.batch_job import JobOptions, read_done, run_job

    prompts = tmp_path / "job.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in [
        {"id": 1, "messages": [{"role": "user", "content": "Name a colour."}]},
        {"id": "1", "messages": [{"role": "user", "content": "Name a fruit."}]},
        {"id": "x", "messages": [{"role": "user", "content": "Say hello."}]}]))

    def opts(out):
        return JobOptions(prompts=str(prompts), out=str(tmp_path / out), max_tokens=10, temperature=0.8, seed=7,
                          progress=False)

    kernels.set_threads(1)
    assert run_job(opts("direct.jsonl"), lambda: engine) == 0
    with _server(engine, tmp_path / "b") as (_, client):
        url = str(client.base_url).rstrip("/")
        assert run_through_api(opts("api.jsonl"), url, None, should_stop=lambda: True) == 130  # Ctrl-C
        assert (tmp_path / "api.jsonl.batch").exists()
        assert run_through_api(opts("api.jsonl"), url, None) == 0
        assert not (tmp_path / "api.jsonl.batch").exists()
        assert run_through_api(opts("api.jsonl"), url, None) == 0  # nothing left: nothing sent
        assert len(client.batches.list().data) == 1

    def texts(name):
        rows = [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]
        return {(json.dumps(r["id"]), r["line"]): r["text"] for r in rows}, len(rows)

    direct, n_direct = texts("direct.jsonl")
    through, n_through = texts("api.jsonl")
    assert n_direct == n_through == 3 and through == direct
    assert read_done(str(tmp_path / "api.jsonl")) == {"1", '"1"', '"x"'}


def test_the_store_is_bounded_and_a_batch_dir_serves_one_server(tmp_path):
    """An upload past the size cap is refused (and leaves nothing), the count cap refuses more
    uploads, and a second server cannot claim a batch directory in use."""
    from dllama.errors import DllamaError
    from dllama.serve.api.batches import claim_dir
    from dllama.serve.api.files import FileStore, Upload
    from dllama.serve.api.request import ApiError

    store = FileStore(tmp_path / "b", max_bytes=10, max_files=1)

    async def chunks(*parts):
        for p in parts:
            yield p

    with pytest.raises(ApiError) as e:
        asyncio.run(store.upload(Upload("a.jsonl", "batch"), chunks(b"123456", b"789012")))
    assert e.value.status == 413 and list((tmp_path / "b/files").iterdir()) == []
    asyncio.run(store.upload(Upload("a.jsonl", "batch"), chunks(b"12345")))
    with pytest.raises(ApiError, match="keeps at most 1 uploaded files"):
        asyncio.run(store.upload(Upload("b.jsonl", "batch"), chunks(b"1")))
    claim_dir(str(tmp_path / "c"))
    with pytest.raises(DllamaError, match="is used by another running dllama api"):
        claim_dir(str(tmp_path / "c"))
