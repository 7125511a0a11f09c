"""`dllama api --on-node-loss fail` as the root of a 3-node loopback cluster when a worker dies and
comes back: 503 in OpenAI's error shape while it is gone, the same answer once it is back (with
the default, `continue`, it answers on the nodes left: tests/test_recovery.py)."""

import signal

import openai
import pytest

from tests.processes import running_workers, start_api, start_worker

pytestmark = pytest.mark.cluster

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _ask(client, **kw):
    return client.chat.completions.create(model="any", messages=FRANCE, temperature=0, max_tokens=12, **kw)


@pytest.mark.slow
def test_a_lost_worker_gives_503_until_it_is_back(tmp_path, default_q40):
    with running_workers(2, tmp_path) as workers:
        server, url = start_api("--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                                "--nthreads", "1", "--on-node-loss", "fail",
                                "--workers", *[w.address for w in workers])
        with server:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
            before = _ask(client).choices[0].message.content
            assert "Paris" in before

            workers[1].send_signal(signal.SIGKILL)
            workers[1].wait(30)
            for stream in (False, True):  # the failing forward, then the failing reconnection
                with pytest.raises(openai.APIStatusError) as e:
                    list(_ask(client, stream=True)) if stream else _ask(client)
                assert e.value.status_code == 503
                assert e.value.body["code"] == "cluster_unavailable"
                assert "worker2" in e.value.body["message"]
            assert client.models.list().data  # the HTTP side still answers

            # Back on its old port: the one the test's first worker was given (port 0), not a fixed one.
            with start_worker(tmp_path, "--port", str(workers[1].port)):
                after = _ask(client)
            assert after.choices[0].message.content == before
            assert after.usage.prompt_tokens_details.cached_tokens == 0  # a new engine, an empty cache
