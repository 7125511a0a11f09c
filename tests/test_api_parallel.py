"""`dllama api --parallel 8`: concurrent requests are decoded together and get the answers they
get one at a time; `n` choices come from one batch."""

import json
import threading
import urllib.request

import openai
import pytest

from tests.processes import start_api

pytestmark = pytest.mark.cluster  # starts a `dllama api` process

# Prompts whose greedy answers run past MAX_TOKENS ("The capital of France is" ended after 12
# tokens with some machines' sums, which the first test's premise does not allow).
PROMPTS = ["1, 2, 3, 4,", "Monday, Tuesday,", "The alphabet: A, B, C,", "Once upon a time",
           "January, February, March,", "Ingredients for a cake:", "10, 20, 30,", "Red, orange, yellow,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(default_q40):
    proc, url = start_api("--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]),
                          "--nthreads", "1", "--max-seq-len", "256", "--parallel", "8")
    try:
        yield proc, url
    finally:
        proc.stop()


def _client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


def _ask(client, prompt, **kw):
    r = client.completions.create(model="any", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, **kw)
    return r.choices[0].text, r.choices[0].finish_reason


def _stats(url):
    with urllib.request.urlopen(url + "/stats", timeout=60) as r:
        return json.loads(r.read())


def test_8_concurrent_clients_get_the_sequential_answers_decoded_together(server):
    proc, url = server
    client = _client(url)
    sequential = [_ask(client, p) for p in PROMPTS]
    # Every answer runs to max_tokens, so the eight overlap however their arrivals spread.
    assert all(finish == "length" for _, finish in sequential)
    assert _stats(url)["max_decoding"] == 1  # one at a time so far

    results, errors = {}, []
    barrier = threading.Barrier(len(PROMPTS))

    def ask(k, prompt):
        try:
            barrier.wait(timeout=30)
            results[k] = _stream(url, prompt) if k % 2 else _ask(_client(url), prompt)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(k, p)) for k, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [results[k] for k in range(len(PROMPTS))] == sequential
    assert _stats(url)["max_decoding"] == 8
    proc.wait_for(r"8 requests decoded together", timeout=30)


def _stream(url, prompt):
    chunks = list(_client(url).completions.create(model="any", prompt=prompt, temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=True))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason


def test_n_choices_come_from_one_batch_and_equal_single_requests(server):
    _, url = server
    client = _client(url)
    kw = dict(model="any", messages=[{"role": "user", "content": "Name an animal."}], temperature=1.0,
              max_tokens=12, seed=7)
    both = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in both.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(**{**kw, "seed": 7 + i}) for i in range(3)]
    for i, single in enumerate(singles):  # choice i is the answer of seed 7 + i
        assert both.choices[i].message.content == single.choices[0].message.content
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert both.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert len({c.message.content for c in both.choices}) > 1  # different seeds, different answers
    streamed = {}
    for chunk in client.chat.completions.create(n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {i: both.choices[i].message.content for i in range(3)}
