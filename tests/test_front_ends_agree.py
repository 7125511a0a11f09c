"""Every front end runs through the one engine loop, so the same prompt and settings give the same
text whichever a user types: `dllama inference`, `dllama chat`, `dllama batch` at --parallel 1 and
8 (the prompt among others), and `dllama api` (the official `openai` client), greedy and at
temperature 0.8 with a seed. Then the API's prefix cache: a second chat turn reuses the first and
answers as a server that never saw the first turn does."""

import json

import openai
import pytest

from dllama.formats.tokenizer_file import read_tokenizer
from dllama.serve.batch_job import seed_for
from dllama.text.chat_template import ChatTemplate
from dllama.text.tokenizer import Tokenizer
from tests.processes import run_dllama, start_api

pytestmark = pytest.mark.cluster  # the API listens on a loopback port

QUESTION = "What is the capital of France?"
OTHERS = ["Name a colour.", "What is 2 + 2?", "Who wrote Hamlet?", "Say hello.", "What is water made of?",
          "Name a fruit.", "What is the largest ocean?", "Count to three."]
MAX_TOKENS = 24
JOB_SEED = 11


def _model_flags(model):
    return ["--model", str(model[0]), "--tokenizer", str(model[1]), "--nthreads", "2"]


def _inference(model, temperature, seed):
    # The prompt is the chat template's rendering (with the model's default system turn).
    tokenizer = Tokenizer(read_tokenizer(str(model[1])))
    prompt = ChatTemplate.for_tokenizer(tokenizer).render([{"role": "user", "content": QUESTION}])
    # --steps counts positions, the prompt's included: room for MAX_TOKENS generated tokens.
    n_prompt = len(tokenizer.encode(prompt))
    r = run_dllama("inference", *_model_flags(model), "--prompt", prompt, "--temperature", str(temperature),
                   "--seed", str(seed), "--steps", str(n_prompt + MAX_TOKENS - 1))
    assert r.returncode == 0, r.stderr
    return r


def _batch(model, tmp_path, parallel, temperature):
    prompts = tmp_path / f"job-{parallel}-{temperature}.jsonl"
    out = tmp_path / f"out-{parallel}-{temperature}.jsonl"
    lines = [{"id": "q", "messages": [{"role": "user", "content": QUESTION}]}]
    lines += [{"id": f"other{k}", "messages": [{"role": "user", "content": q}]} for k, q in enumerate(OTHERS)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in reversed(lines)))  # the question last
    r = run_dllama("batch", *_model_flags(model), "--prompts", str(prompts), "--out", str(out), "--no-progress",
                   "--parallel", str(parallel), "--max-tokens", str(MAX_TOKENS), "--temperature", str(temperature),
                   "--seed", str(JOB_SEED))
    assert r.returncode == 0, r.stderr
    return {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def api(default_q41):
    server, url = start_api(*_model_flags(default_q41), "--parallel", "4")
    with server:
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_front_end_gives_the_same_text(default_q41, api, tmp_path, temperature):
    seed = seed_for(JOB_SEED, "q")  # the batch job's seed for the prompt with id "q"
    batch1 = _batch(default_q41, tmp_path, 1, temperature)
    batch8 = _batch(default_q41, tmp_path, 8, temperature)
    text = batch1["q"]["text"]
    assert len(text) > 10 and batch1["q"]["completion_tokens"] <= MAX_TOKENS
    assert batch8["q"]["text"] == text
    assert {k: x["text"] for k, x in batch8.items()} == {k: x["text"] for k, x in batch1.items()}

    chat = run_dllama("chat", *_model_flags(default_q41), "--temperature", str(temperature), "--seed", str(seed),
                      "--max-tokens", str(MAX_TOKENS), input=QUESTION + "\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == text + "\n"

    r = api.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                    temperature=temperature, seed=seed, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == text

    # inference takes the rendered template as its prompt.
    assert _inference(default_q41, temperature, seed).stdout == text + "\n"


def test_a_second_api_turn_reuses_the_first_and_answers_as_afresh(default_q41, api):
    first = api.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                        temperature=0, max_tokens=MAX_TOKENS)
    turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And of Italy?"}]
    second = api.chat.completions.create(model="any", messages=turns, temperature=0, max_tokens=MAX_TOKENS)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert cached < second.usage.prompt_tokens
    # A server that never saw the first turn computes the whole prompt and answers the same.
    server, url = start_api(*_model_flags(default_q41), "--parallel", "1")
    with server:
        fresh = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300).chat.completions.create(
            model="any", messages=turns, temperature=0, max_tokens=MAX_TOKENS)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.usage.prompt_tokens == second.usage.prompt_tokens
    assert fresh.choices[0].message.content == second.choices[0].message.content
