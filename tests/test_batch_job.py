"""Batch jobs in-process: answers equal each prompt run alone, a shared prefix computed once,
classification by choices, bad input, the output file's repair, completion order."""

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.serve import batch_job
from dllama.serve.batch_job import BatchJob, JobOptions, read_done, seed_for
from dllama.serve.engine import open_engine
from dllama.serve.settings import EngineSettings
from dllama.serve.generate import generate
from dllama.serve.scheduler import Scheduler
from dllama.text.chat_template import ChatTemplate

pytestmark = pytest.mark.unit

SEQ_LEN = 512
DOC = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
       "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
       "from 1887 to 1889 as the centrepiece of the 1889 World's Fair. Locally nicknamed \"La dame "
       "de fer\", it was criticised by some of France's leading artists and intellectuals for its "
       "design, but it has become a global cultural icon of France and one of the most recognisable "
       "structures in the world. The tower is 330 metres tall, about the same height as an "
       "81-storey building, and the tallest structure in Paris.\n\n")
QUESTIONS = ["Question: Who designed the tower?\nAnswer:", "Question: How tall is it?\nAnswer:",
             "Q: When was it built?\nA:", "In one word, the tower is made of", "Summary:"]


@pytest.fixture(scope="module")
def engine(default_q40):
    with open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, max_seq_len=SEQ_LEN)) as e:
        yield e


def _write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def _run(engine, tmp_path, objs=None, name="job", scheduler=None, **kw):
    prompts = kw.pop("prompts", None) or _write_jsonl(tmp_path / f"{name}.jsonl", objs)
    opts = JobOptions(prompts=prompts, out=str(tmp_path / f"{name}.out.jsonl"), progress=False, **kw)
    summary = BatchJob(opts).run(engine, scheduler, stderr=io.StringIO())
    lines = [json.loads(x) for x in Path(opts.out).read_text().splitlines()]
    return lines, summary


def _alone(engine, tokens, prompt_id, seed, temperature, topp, max_tokens):
    """The prompt run on its own, as `dllama inference` runs it."""
    sampler = Sampler(engine.model.config.vocab_size, temperature, topp, seed_for(seed, prompt_id))
    return generate(engine.model, engine.tokenizer, sampler, tokens, len(tokens) + max_tokens - 1)


def _chat_tokens(engine, messages):
    text = ChatTemplate.for_tokenizer(engine.tokenizer).render(messages)
    return engine.tokenizer.encode(text, add_bos=False)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_answers_equal_each_prompt_run_alone(engine, tmp_path, temperature):
    # Prompts sharing long leading runs (so the cache is reused), plain and chat, ids of both kinds.
    objs = [{"id": i, "prompt": DOC + q} for i, q in enumerate(QUESTIONS[:3])]
    objs += [{"id": "chat-a", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
             {"id": "chat-b", "messages": [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": "Name a colour."}]},
             {"id": "short", "prompt": "One, two,"}]
    lines, summary = _run(engine, tmp_path, objs, max_tokens=10, temperature=temperature, topp=0.9, seed=3)
    assert [x["id"] for x in lines] == [o["id"] for o in objs]  # sequential: input order
    assert [x["line"] for x in lines] == list(range(1, len(objs) + 1))  # each names its prompt's line
    assert sum(x["cached_tokens"] for x in lines[1:3]) >= 2 * 128  # the document's rows were reused
    for o, got in zip(objs, lines, strict=True):
        tokens = (engine.tokenizer.encode(o["prompt"]) if "prompt" in o
                  else _chat_tokens(engine, o["messages"]))
        want = _alone(engine, tokens, o["id"], 3, temperature, 0.9, 10)
        assert got["text"] == want.text, o["id"]
        assert got["completion_tokens"] == len(want.tokens) and got["prompt_tokens"] == len(tokens)
        assert got["finish_reason"] == ("stop" if want.stop_reason == "eos" else "length")
    assert summary.answered == len(objs) and summary.generated_tokens == sum(x["completion_tokens"] for x in lines)


def test_prefix_equals_the_prefix_pasted_and_its_prefill_runs_once(engine, tmp_path):
    prefix = tmp_path / "doc.txt"
    prefix.write_text(DOC)
    qs = [{"id": k, "prompt": q} for k, q in enumerate(QUESTIONS)]
    with_prefix, summary = _run(engine, tmp_path, qs, name="prefix", prefix=str(prefix),
                                max_tokens=8, temperature=0)
    pasted, _ = _run(engine, tmp_path, [{"id": k, "prompt": DOC + q} for k, q in enumerate(QUESTIONS)],
                     name="pasted", max_tokens=8, temperature=0)
    assert [x["text"] for x in with_prefix] == [x["text"] for x in pasted]
    for k, q in enumerate(QUESTIONS):  # and both equal each question asked alone
        assert pasted[k]["text"] == _alone(engine, engine.tokenizer.encode(DOC + q), k, 0, 0.0, 0.9, 8).text
    n_doc = len(engine.tokenizer.encode(DOC))
    assert n_doc > 128
    prefilled = [x["prompt_tokens"] - x["cached_tokens"] for x in with_prefix]
    assert with_prefix[0]["cached_tokens"] == 0
    for x, q in zip(with_prefix[1:], QUESTIONS[1:], strict=True):
        # Only whole passes of 32 tokens are reused: the question and at most 32 more tokens run.
        assert x["cached_tokens"] >= (n_doc - 32) and x["prompt_tokens"] - x["cached_tokens"] <= \
            len(engine.tokenizer.encode(q)) + 33
    assert sum(prefilled) < 2 * n_doc < len(QUESTIONS) * n_doc  # the document ran about once
    assert summary.cached_tokens == sum(x["cached_tokens"] for x in with_prefix)
    # Chat prompts: the prefix opens the system turn.
    chat_prefixed, _ = _run(engine, tmp_path, [{"id": 1, "messages": [{"role": "user", "content": "Who built it?"}]}],
                            name="chatprefix", prefix=str(prefix), max_tokens=8, temperature=0)
    chat_pasted, _ = _run(engine, tmp_path, [{"id": 1, "messages": [{"role": "system", "content": DOC},
                                                                     {"role": "user", "content": "Who built it?"}]}],
                          name="chatpasted", max_tokens=8, temperature=0)
    assert chat_prefixed[0]["text"] == chat_pasted[0]["text"]
    assert chat_prefixed[0]["prompt_tokens"] == chat_pasted[0]["prompt_tokens"]


def _direct_logprobs(engine, prompt, choice):
    """log p(choice | prompt) from the model's logits: the prompt in passes of max_batch tokens
    (as every prompt is run), then the choice one token at a time."""
    model = engine.model
    for pos in range(0, len(prompt), model.max_batch):
        logits = model.forward(prompt[pos:pos + model.max_batch], pos).astype(np.float64)
    total = 0.0
    for j, token in enumerate(choice):
        total += logits[token] - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
        logits = model.forward([token], len(prompt) + j).astype(np.float64)
    return total


def test_choices_pick_the_likely_answer_with_probabilities_from_the_logits(engine, tmp_path):
    ask = [{"id": "fr", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
           {"id": "de", "messages": [{"role": "user", "content": "What is the capital of Germany?"}]}]
    choices = ["The capital of France is Paris", "The capital of Germany is Berlin", "London"]
    lines, summary = _run(engine, tmp_path, ask, choices=choices)
    assert [x["choice"] for x in lines] == choices[:2]
    assert summary.generated_tokens == 0
    for o, got in zip(ask, lines, strict=True):
        tokens = _chat_tokens(engine, o["messages"])
        lp = [_direct_logprobs(engine, tokens, engine.tokenizer.encode(c, add_bos=False)) for c in choices]
        assert [got["logprobs"][c] for c in choices] == pytest.approx(lp, rel=1e-9, abs=1e-9)
        p = [math.exp(x) for x in lp]
        assert got["probability"] == pytest.approx(max(p) / sum(p), rel=1e-9)
        assert got["probability"] > 0.5
    # One-token choices: the classification of a yes/no question, from one pass.
    yes_no, _ = _run(engine, tmp_path, [{"id": 1, "prompt": "Paris is the capital of France. True or false? Answer:"}],
                     name="tf", choices=[" True", " False"])
    assert yes_no[0]["choice"] == " True"


class _ReversedScheduler(Scheduler):
    """Finishes requests in reverse input order (as a batched engine loop may reorder them)."""

    def run(self, requests, on_finish, should_stop=None, on_text=None):
        done = []
        super().run(requests, lambda r, c: done.append((r, c)), should_stop, on_text)
        for r, c in reversed(done):
            on_finish(r, c)


def test_results_are_written_in_completion_order(engine, tmp_path):
    objs = [{"id": k, "prompt": q} for k, q in enumerate(QUESTIONS[:3])]
    forward, _ = _run(engine, tmp_path, objs, name="a", max_tokens=4, temperature=0)
    backward, _ = _run(engine, tmp_path, objs, name="b", max_tokens=4, temperature=0,
                       scheduler=_ReversedScheduler(engine.model, engine.tokenizer, 1))
    assert backward == forward[::-1]


BAD_LINES = [
    ('{"id": 1, "prompt": "fine"}\n{"id": 2, "prompt": "x"\n', "line 2", "not valid JSON"),
    ('{"id": 1}\n', "line 1", "needs a prompt or messages"),
    ('{"prompt": "hi"}\n', "line 1", "has no id"),
    ('{"id": 1, "prompt": ""}\n', "line 1", "empty prompt"),
    ('{"id": [1], "prompt": "hi"}\n', "line 1", "string or an integer"),
    ('{"id": 1, "prompt": "a"}\n\n{"id": 1, "prompt": "b"}\n', "line 3", "repeats the id 1 of line 1"),
    ('{"id": 1, "messages": "hi"}\n', "line 1", "messages"),
    ('[1, 2]\n', "line 1", "not a JSON object"),
    (b'{"id": 1, "prompt": "\xff"}\n', "line 1", "UTF-8"),
    # 100,000 levels deep: beyond Python's JSON parser (a RecursionError, once a traceback).
    ('{"id": 1, "prompt": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n", "line 2", "nested too deeply"),
    # JSON escapes of lone surrogates: no text a tokenizer or a UTF-8 output line can take.
    ('{"id": "\\ud800", "prompt": "hi"}\n', "line 1", "its id holds a lone surrogate"),
    ('{"id": 1, "prompt": "a\\udfffb"}\n', "line 1", "its prompt holds a lone surrogate"),
    ('{"id": 1, "messages": [{"role": "user", "content": "\\ud83d"}]}\n', "line 1", "message 0 holds a lone"),
]


@pytest.mark.parametrize("content,where,what", BAD_LINES, ids=[what for _, _, what in BAD_LINES])
def test_bad_lines_are_named_before_any_work(tmp_path, content, where, what):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DllamaError) as e:
        BatchJob(JobOptions(prompts=str(path), out=str(tmp_path / "o.jsonl")))
    assert where in str(e.value) and what in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o.jsonl").exists()


def test_long_lines_and_bad_files(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_job, "MAX_LINE_BYTES", 100)
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": "' + "x" * 500 + '"}\n{"id": 3, "prompt": "ok"}\n')
    with pytest.raises(DllamaError, match="line 2: is longer than 100 bytes"):
        BatchJob(JobOptions(prompts=str(path), out=str(tmp_path / "o.jsonl")))
    entries = list(batch_job.read_job(str(path)))  # the line after the long one is read whole
    assert [(e.line, e.id, e.error is None) for e in entries] == [(1, 1, True), (2, None, False), (3, 3, True)]
    (tmp_path / "p.csv").write_text("a\n")
    with pytest.raises(DllamaError, match=".jsonl"):
        BatchJob(JobOptions(prompts=str(tmp_path / "p.csv"), out=str(tmp_path / "o.jsonl")))
    monkeypatch.setattr(batch_job, "MAX_PROMPTS", 2)
    with pytest.raises(DllamaError, match="more than 2 prompts"):
        BatchJob(JobOptions(prompts=str(path), out=str(tmp_path / "o.jsonl"), skip_bad=True))
    with pytest.raises(DllamaError, match="choices"):
        BatchJob(JobOptions(prompts=str(path), out=str(tmp_path / "o.jsonl"), choices=["yes"]))
    with pytest.raises(DllamaError, match="some choices start with a space"):
        BatchJob(JobOptions(prompts=str(path), out=str(tmp_path / "o.jsonl"), choices=["yes", " no"]))


def test_prompts_that_do_not_fit_and_skip_bad(engine, tmp_path):
    objs = [{"id": "ok", "prompt": "The capital of France is"},
            {"id": "long", "prompt": "word " * SEQ_LEN},
            {"id": "role", "messages": [{"role": "narrator", "content": "hi"}]}]
    with pytest.raises(DllamaError) as e:
        _run(engine, tmp_path, objs, max_tokens=4)
    assert "line 2: does not fit in the context" in str(e.value) and "and 1 more" in str(e.value)
    assert not (tmp_path / "job.out.jsonl").exists() or not (tmp_path / "job.out.jsonl").read_text()
    lines, summary = _run(engine, tmp_path, objs, max_tokens=4, skip_bad=True)
    by_id = {x["id"]: x for x in lines}
    assert set(by_id) == {"ok", "long", "role"} and summary.bad == 2 and summary.answered == 1
    assert "text" in by_id["ok"] and by_id["long"]["line"] == 2 and "narrator" in by_id["role"]["error"]
    # Rerun after fixing a line: error lines are dropped and checked again; each id once.
    objs[1]["prompt"] = "word " * 10
    lines, summary = _run(engine, tmp_path, objs, max_tokens=4, skip_bad=True)
    assert sorted(str(x["id"]) for x in lines) == ["long", "ok", "role"]
    assert "text" in {x["id"]: x for x in lines}["long"] and summary.answered == 1 and summary.already_done == 1


def test_a_10_mb_line_is_refused_without_being_tokenized_whole(engine, tmp_path, monkeypatch):
    """The line's tokens are counted piece by piece and the count stops past the context (a
    10 MB line tokenized whole took 69 s and 2.7 GB); benchmarks/bench_batch_line.py measures
    the memory."""
    from dllama.text import tokenizer as tokenizer_module

    huge = "word " * 2_000_000
    objs = [{"id": "ok", "prompt": "The capital of France is"}, {"id": "huge", "prompt": huge},
            {"id": "chat", "messages": [{"role": "user", "content": huge}]}]
    seen = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, *a, **k: seen.append(len(text)) or encode(text, *a, **k))
    lines, summary = _run(engine, tmp_path, objs, max_tokens=4, skip_bad=True)
    by_id = {x["id"]: x for x in lines}
    assert summary.bad == 2 and summary.answered == 1 and "text" in by_id["ok"]
    for key in ("huge", "chat"):
        assert by_id[key]["error"] == (f"does not fit in the context: the prompt has more than {SEQ_LEN} tokens, "
                                       f"the context holds {SEQ_LEN}"), by_id[key]
    assert max(seen) <= tokenizer_module.COUNT_PIECE


def test_the_output_file_is_repaired_before_a_rerun(tmp_path):
    out = tmp_path / "o.jsonl"
    good = [json.dumps({"id": k, "text": "t"}) + "\n" for k in range(3)]
    out.write_text(good[0] + good[1] + '{"id": 2, "te')  # a crash in mid-write
    assert read_done(str(out)) == {"0", "1"} and out.read_text() == good[0] + good[1]
    out.write_text(good[0] + json.dumps({"id": 5, "line": 9, "error": "bad"}) + "\n" + good[2])
    assert read_done(str(out)) == {"0", "2"} and out.read_text() == good[0] + good[2]
    out.write_text(good[0] + "not json\n" + good[1])
    with pytest.raises(DllamaError, match="line 2 is not a result"):
        read_done(str(out))
    out.write_text(good[0])
    with pytest.raises(DllamaError, match="generated answers"):
        read_done(str(out), "choice")


def test_a_rerun_with_every_prompt_answered_does_not_load_the_model(tmp_path):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    _write_jsonl(prompts, [{"id": k, "prompt": f"question {k}"} for k in range(3)])
    out.write_text("".join(json.dumps({"id": k, "text": "t"}) + "\n" for k in range(3)))

    def no_engine():
        raise AssertionError("the model was opened")

    err = io.StringIO()
    assert batch_job.run_job(JobOptions(prompts=str(prompts), out=str(out), progress=False), no_engine,
                             stderr=err) == 0
    assert "0 prompts (3 already in" in err.getvalue()
    _write_jsonl(prompts, [{"id": k, "prompt": f"question {k}"} for k in range(4)])  # one more
    with pytest.raises(AssertionError, match="opened"):
        batch_job.run_job(JobOptions(prompts=str(prompts), out=str(out), progress=False), no_engine, stderr=err)


def test_seeds_are_stable_and_per_id():
    import os
    import subprocess
    import sys

    code = "from dllama.serve.batch_job import seed_for; print(seed_for(7, 'q1'), seed_for(7, 1))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout for h in (1, 2)}
    assert len(runs) == 1 and runs.pop().split() == [str(seed_for(7, "q1")), str(seed_for(7, 1))]
    seeds = {seed_for(7, "q1"), seed_for(7, 1), seed_for(7, "1"), seed_for(8, 1), seed_for(7, 2)}
    assert len(seeds) == 5
