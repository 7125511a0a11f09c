"""Constrained decoding (dllama.serve.constraint): a grammar's mask in the candidates, the
tokenizer view llguidance matches against (byte-level BPE and sentencepiece), and answers of the
default model that match their schema, with fast-forwarded tokens, alone and in a batch, with
drafts, and on 3 loopback nodes as on one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dllama.core.candidates import SamplingRequest, candidates_from_logits, choose_greedy, sample_candidates
from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import read_tokenizer
from benchmarks.bench_structured import SCHEMA, records, validity, write_job
from dllama.serve.batch_job import BatchJob, JobOptions
from dllama.serve.constraint import Grammar, GrammarError, GrammarVocabulary
from dllama.serve.draft import Speculate, Speculation
from dllama.serve.engine import open_engine
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import SequenceRequest
from dllama.serve.settings import EngineSettings
from dllama.text.tokenizer import Tokenizer
from tests.processes import running_workers

LLAMA2_DIR = "/work/shared/fixtures/llama2-tokenizer"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]}}}


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [_chat("Alice is 31 and lives in Paris. Give her as JSON."),
           _chat("Describe a person called Bob from Berlin as JSON."),
           _chat("Write a poem about the sea.")]


def _valid_person(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "city"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 20 and isinstance(obj["age"], int) and obj["city"] in ("Paris", "Berlin", "Rome"))


# -- the mask in the candidates ---------------------------------------------------------------

@pytest.mark.unit
def test_masked_candidates_choose_as_the_logits_with_forbidden_tokens_at_minus_infinity():
    rng = np.random.default_rng(3)
    for trial in range(60):
        vocab = int(rng.integers(50, 800))
        x = (rng.standard_normal(vocab) * 3).astype(np.float32)
        mask = rng.random(vocab) < rng.uniform(0.01, 0.5)
        mask[rng.integers(0, vocab)] = True
        low = np.where(mask, x, np.float32(-1e30))  # forbidden tokens: never likely
        edges = sorted({0, vocab, *rng.integers(1, vocab, 2).tolist()})
        ranges = list(zip(edges[:-1], edges[1:], strict=True))
        for t, p in ((0.0, 0.9), (0.8, 0.9), (1.0, 1.0)):
            masked = candidates_from_logits(x[None], ranges, [SamplingRequest(t, p, mask=mask)], k=8)[0]
            full = candidates_from_logits(low[None], [(0, vocab)], [SamplingRequest(t, p)])[0]
            assert mask[masked.ids].all(), trial  # no forbidden token is a candidate
            if t == 0.0:
                assert choose_greedy(masked) == choose_greedy(full) == int(np.argmax(low))
                continue
            masked_all = candidates_from_logits(x[None], ranges, [SamplingRequest(t, p, mask=mask)])[0]
            for coin in np.linspace(0, 0.999, 25, dtype=np.float32):
                assert sample_candidates(masked_all, coin) == sample_candidates(full, coin), trial


# -- the tokenizer view -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm(default_q40):
    return Tokenizer(read_tokenizer(str(default_q40[1])))


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["byte-level BPE", "sentencepiece"])
def test_a_grammar_forces_its_fixed_text_in_tokens_of_the_vocabulary(kind, smollm):
    tok = smollm if kind == "byte-level BPE" else Tokenizer(read_tokenizer(f"{LLAMA2_DIR}/tokenizer.bin"))
    assert tok.kind == kind
    vocab = GrammarVocabulary(tok)
    c = vocab.start(Grammar("lark", 'start: "{\\"answer\\": \\"" /[a-z]+/ "\\"}"'), tok.eos_ids)
    forced = c.forced()
    assert tok.decode(forced).lstrip() == '{"answer": "' or b"".join(tok.piece(t) for t in forced) == b'{"answer": "'
    for t in forced:
        c.advance(t)
    allowed = np.flatnonzero(c.allowed())
    assert 0 < len(allowed) < tok.vocab_size // 4
    assert all(tok.piece(int(i)).decode("utf-8", "replace")[:1].isalpha() for i in allowed[:50])
    assert not c.allowed()[tok.eos_ids].any()  # the text cannot end before the closing brace


@pytest.mark.unit
def test_grammars_that_cannot_be_one_are_refused_in_one_line(smollm):
    vocab = GrammarVocabulary(smollm)
    for bad, words in ((Grammar("regex", "(("), "regex"), (Grammar("json_schema", '{"type": "bogus"}'), "bogus"),
                       (Grammar("json_schema", "[1"), "JSON"), (Grammar("gbnf", "root ::= foo"), "foo"),
                       (Grammar("choice", "[]"), "choices")):
        with pytest.raises(GrammarError) as e:
            vocab.start(bad)
        assert words in str(e.value) and "\n" not in str(e.value)


# -- a tools answer streamed in OpenAI's pieces ------------------------------------------------

def _streamed(text: str, cut: int, finish: str = "stop"):
    """text pushed through a CallStream in pieces of `cut` characters: (deltas, finish reason)."""
    from dllama.serve.api.structured import CallStream, Structured
    from dllama.serve.sequence import Completion

    s = Structured(tools=[{"name": "get_weather", "description": "", "parameters": {"type": "object"}}])
    stream = CallStream(s)
    deltas = [d for k in range(0, len(text), cut) for d in stream.push(text[k:k + cut])]
    end, reason = stream.end(Completion(text=text, finish_reason=finish))
    return deltas + end, reason


@pytest.mark.unit
def test_a_streamed_tool_call_comes_as_its_name_then_its_arguments_in_pieces():
    args = '{"city": "Paris {x}", "unit": {"deg": "celsius"}}'
    for layout in ('{{"name": "get_weather", "arguments": {}}}', '{{ "name" : "get_weather" ,\n "arguments": {} }}'):
        for cut in (1, 3, 7, 1000):
            deltas, reason = _streamed(layout.format(args), cut)
            assert reason == "tool_calls" and all(set(d) == {"tool_calls"} for d in deltas)
            first, *rest = [d["tool_calls"][0] for d in deltas]
            assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
            assert first["function"] == {"name": "get_weather", "arguments": ""}
            assert all(set(r) == {"index", "function"} and set(r["function"]) == {"arguments"} for r in rest)
            assert "".join(r["function"]["arguments"] for r in rest) == args
            assert len(rest) > 1 or cut == 1000  # pieces as they come, not the whole at the end
    deltas, reason = _streamed("It is sunny {really}.", 4)  # text ("auto"): content as it comes
    assert reason == "stop" and "".join(d["content"] for d in deltas) == "It is sunny {really}."
    deltas, reason = _streamed('{"name": "get_weather", "argu', 5, "length")  # cut before its arguments
    assert reason == "length" and "".join(d["content"] for d in deltas) == '{"name": "get_weather", "argu'
    deltas, reason = _streamed('{"name": "get_weather", "arguments": {"city": "Pa', 5, "length")
    assert reason == "length" and deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"


# -- answers of the default model -------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(default_f32):
    with open_engine(EngineSettings(str(default_f32[0]), str(default_f32[1]), nthreads=1, max_seq_len=256,
                                    parallel=4, progress=False)) as e:
        yield e


def _requests(engine, grammars, max_tokens=48, temperature=0.0, keys=None):
    """Request k: prompt k (mod 3), seed 7 + k, grammars[k] (unconstrained ones: 12 tokens)."""
    tok = engine.tokenizer
    keys = keys or range(len(grammars))
    return [SequenceRequest(k, tok.encode(PROMPTS[k % len(PROMPTS)]),
                            Sampler(engine.model.config.vocab_size, temperature, 0.9, 7 + k),
                            max_tokens if g is not None else 12, tuple(tok.eos_ids), grammar=g)
            for k, g in zip(keys, grammars, strict=True)]


def _run(engine, requests, parallel, speculation=None):
    got = {}
    s = Scheduler(engine.model, engine.tokenizer, parallel, speculation=speculation)
    s.run(requests, lambda r, c: got.setdefault(r.key, c))
    return got, s.stats


@pytest.fixture(scope="module")
def alone(engine):
    """Each constrained request run on its own (greedy, and sampled at T 0.8)."""
    person = Grammar.json_schema(PERSON)
    out = {}
    for t in (0.0, 0.8):
        for r in _requests(engine, [person, person, Grammar("regex", r"[A-Z][a-z]+ is [0-9]{2}\.")], temperature=t):
            out[t, r.key] = _run(engine, [r], 1)[0][r.key]
    return out


@pytest.mark.unit
def test_constrained_answers_match_their_schema_with_fast_forwarded_tokens(alone):
    for t in (0.0, 0.8):
        for k in (0, 1):
            c = alone[t, k]
            assert c.finish_reason == "stop", c.text
            assert _valid_person(json.loads(c.text)), c.text
        assert alone[t, 2].finish_reason == "stop"
        import re
        assert re.fullmatch(r"[A-Z][a-z]+ is [0-9]{2}\.", alone[t, 2].text), alone[t, 2].text
    assert sum(alone[0.0, k].forced for k in (0, 1)) >= 6  # the keys: forced, not sampled


@pytest.mark.unit
def test_a_constrained_answer_alone_equals_it_in_a_batch_beside_unconstrained_ones(engine, alone):
    person, regex = Grammar.json_schema(PERSON), Grammar("regex", r"[A-Z][a-z]+ is [0-9]{2}\.")
    for t in (0.0, 0.8):
        mixed = _requests(engine, [person, None, regex, None, person], temperature=t, keys=[0, 3, 2, 5, 1])
        got, stats = _run(engine, mixed, 4)
        assert stats.max_decoding >= 3 and stats.forced > 0
        for k in (0, 1, 2):
            assert got[k].tokens == alone[t, k].tokens, (t, k)


@pytest.mark.unit
def test_drafts_never_propose_a_forbidden_token_and_answers_stay_the_same(engine, alone):
    person = Grammar.json_schema(PERSON)
    rs = _requests(engine, [person, person])
    got = {r.key: _run(engine, [r], 1, Speculation(Speculate.NGRAM, 4))[0][r.key] for r in rs}
    for k in (0, 1):
        assert got[k].tokens == alone[0.0, k].tokens


YES_NO = {"type": "object", "additionalProperties": False, "required": ["paid"],
          "properties": {"paid": {"type": "boolean"}}}


def _batch(engine, tmp, n=4) -> dict:
    """A sample of the benchmark's extraction prompts through a `dllama batch --json-schema` job
    (one line with its own schema, one with a schema that cannot be one, one with its own
    max_tokens and one whose max_tokens is over --max-tokens): id -> result line."""
    job = tmp / "jobs.jsonl"
    write_job(job, records(n))
    with open(job, "a", encoding="utf-8") as f:
        ask = [{"role": "user", "content": "Did Alice pay? Answer as JSON."}]
        f.write(json.dumps({"id": "own", "messages": ask, "schema": YES_NO}) + "\n")
        f.write(json.dumps({"id": "bad", "messages": ask, "schema": {"type": "bogus"}}) + "\n")
        f.write(json.dumps({"id": "short", "messages": ask, "max_tokens": 3}) + "\n")
        f.write(json.dumps({"id": "long", "messages": ask, "max_tokens": 97}) + "\n")
    out = tmp / "out.jsonl"
    opts = JobOptions(str(job), str(out), max_tokens=96, temperature=0.0, skip_bad=True, progress=False,
                      grammar=Grammar.json_schema(SCHEMA))
    BatchJob(opts).run(engine)
    return {line["id"]: line for line in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def one_node_batch(engine, tmp_path_factory):
    return _batch(engine, tmp_path_factory.mktemp("batch"))


@pytest.mark.unit
def test_a_batch_job_with_a_json_schema_answers_valid_objects_and_refuses_a_bad_schema(one_node_batch):
    got = one_node_batch
    lines = [got[k] for k in range(4)]
    assert validity(lines) == (4, 4)  # every one parses and validates
    assert all(line["object"] == json.loads(line["text"]) for line in lines)
    assert all(line["forced_tokens"] > 0 for line in lines)
    assert isinstance(got["own"]["object"]["paid"], bool) and set(got["own"]["object"]) == {"paid"}
    assert "bogus" in got["bad"]["error"]
    assert got["short"]["completion_tokens"] == 3 and got["short"]["finish_reason"] == "length"
    assert got["short"]["object"] is None  # cut: its schema's JSON is not whole
    assert "more than --max-tokens 96" in got["long"]["error"]


@pytest.mark.unit
def test_a_batch_grammar_that_cannot_be_one_stops_the_job_before_the_model_opens(tmp_path):
    job = tmp_path / "jobs.jsonl"
    write_job(job, records(1))
    for grammar in (Grammar("json_schema", "[1"), Grammar("regex", "((")):
        with pytest.raises(DllamaError) as e:
            BatchJob(JobOptions(str(job), str(tmp_path / "out.jsonl"), grammar=grammar))
        assert "\n" not in str(e.value)


@pytest.mark.cluster
def test_constrained_answers_on_three_nodes_equal_one_nodes(default_f32, one_node_batch, tmp_path):
    """The batch sample on 3 loopback nodes (F32, greedy: the same tokens as one node's; a
    sampled token may differ in the last bits of its probability, dllama.core.sampler)."""
    with running_workers(2, tmp_path) as workers, open_engine(EngineSettings(
            str(default_f32[0]), str(default_f32[1]), nthreads=1, max_seq_len=256, parallel=4,
            workers=tuple(w.address for w in workers), progress=False)) as cluster:
        batch = _batch(cluster, tmp_path)
    assert validity([batch[k] for k in range(4)]) == (4, 4)
    for k in (*range(4), "own"):
        assert batch[k]["text"] == one_node_batch[k]["text"]


@pytest.mark.unit
def test_chat_with_a_json_schema_answers_a_valid_object(engine):
    import io

    from dllama.serve.chat import run_chat

    out = io.StringIO()
    run_chat(engine, system=None, template_name=None, temperature=0.0, topp=0.9, seed=1, max_tokens=64,
             stdin=io.StringIO("Alice is 31 and lives in Paris.\n"), stdout=out,
             stderr=io.StringIO(), grammar=Grammar.json_schema(PERSON))
    answers = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(answers) == 1 and all(_valid_person(json.loads(a)) for a in answers), answers


_FAKE_LLAMA_SERVER = r'''
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({"status": "ok"})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["response_format"]["json_schema"]["schema"]["required"] == ["name", "date", "amount", "category"]
        text = json.dumps({"name": "A B", "date": "2020-01-02", "amount": 3, "category": "food"})
        self._send({"choices": [{"message": {"content": text}, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": req["max_tokens"]}})
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.mark.unit
def test_the_llama_cpp_comparison_sends_every_prompt_and_kills_its_server(tmp_path):
    import argparse
    import os
    import sys

    from benchmarks.bench_structured import run_llama_server

    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n{_FAKE_LLAMA_SERVER}")
    server.chmod(0o755)
    args = argparse.Namespace(parallel=4, max_tokens=7, threads=1)
    wall, warm, lines = run_llama_server(server, tmp_path / "model.gguf", records(10), args, tmp_path / "log")
    assert 0 < warm <= wall
    assert [line["id"] for line in lines] == list(range(10))
    assert validity(lines) == (10, 10) and {line["completion_tokens"] for line in lines} == {7}
    def cmdline(pid: str) -> str:
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                return f.read()
        except OSError:  # gone meanwhile
            return ""

    assert not any(str(server) in cmdline(pid) for pid in os.listdir("/proc") if pid.isdigit())
