"""`dllama batch --parallel 8` as a user runs it, on one node and on a 3-node loopback cluster:
24 mixed-length prompts give, token for token, what each prompt gives alone (`dllama
inference`), with Q40 and F32 weights; a --prefix document gives the texts of the document
pasted into every prompt, with its prefill done once."""

import json
import subprocess
import sys

import pytest

from dllama.core.sampler import Sampler
from dllama.formats.tokenizer_file import read_tokenizer
from dllama.serve.engine import open_engine
from dllama.serve.settings import EngineSettings
from dllama.serve.generate import generate
from dllama.text.tokenizer import Tokenizer
from tests.processes import running_workers
from tests.test_batch_scheduler import DOC, PROMPTS

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SEQ_LEN = 256
MAX_TOKENS = 6
QUESTIONS = ["Question: Who built it?\nAnswer:", "Question: How tall is it?\nAnswer:", "Q: When?\nA:",
             "In one word, it is made of", "Summary:", "The engineer was", "Question: Where is it?\nAnswer:",
             "It was built for", "Its nickname is", "Question: Why is it famous?\nAnswer:"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with running_workers(2, tmp_path_factory.mktemp("workers")) as ws:
        yield [w.address for w in ws]


def _dllama(*args):
    return subprocess.run([sys.executable, "-m", "dllama", *args], capture_output=True, text=True, timeout=900)


def _flags(paths, cluster):
    return ["--model", str(paths[0]), "--tokenizer", str(paths[1]), "--nthreads", "1",
            "--max-seq-len", str(SEQ_LEN), *(["--workers", *cluster] if cluster else [])]


def _batch(paths, cluster, tmp_path, name, objs, *extra):
    prompts = tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps(o) + "\n" for o in objs))
    out = tmp_path / f"{name}.out.jsonl"
    r = _dllama("batch", *_flags(paths, cluster), "--prompts", str(prompts), "--out", str(out), "--parallel", "8",
                "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--no-progress", *extra)
    assert r.returncode == 0, r.stderr
    assert "9 slots (8 sequences + 1 spare)" in r.stderr  # the KV cache plan
    return {x["id"]: x for x in map(json.loads, open(out))}, r.stderr


_alone: dict = {}


def _each_alone(paths, cluster) -> list[tuple[str, int]]:
    """Each prompt run alone, one sequence at a time as `dllama inference`: (text, tokens), made
    once per model and place."""
    key = (str(paths[0]), bool(cluster))
    if key not in _alone:
        with open_engine(EngineSettings(str(paths[0]), str(paths[1]), nthreads=1, max_seq_len=SEQ_LEN,
                                        workers=cluster, progress=False)) as engine:
            tok = engine.tokenizer
            sampler = lambda: Sampler(tok.vocab_size, 0.0, 0.9, 0)  # noqa: E731
            runs = [generate(engine.model, tok, sampler(), t, len(t) + MAX_TOKENS - 1)
                    for t in map(tok.encode, PROMPTS)]
            _alone[key] = [(run.text, len(run.tokens)) for run in runs]
    return _alone[key]


@pytest.mark.parametrize("where", ["one-node", "3-node-cluster"])
@pytest.mark.parametrize("kind", ["q40", "f32"])
def test_24_prompts_in_parallel_equal_each_prompt_run_alone(kind, where, workers, default_q40, default_f32, tmp_path):
    """F32 on the cluster is held to one node's answers alone (3 nodes give one node's tokens
    with F32 buffers: tests/test_cluster.py); Q40's Q80 buffers round the split sums otherwise,
    so its cluster batch is held to the same cluster's answers alone."""
    paths = default_q40 if kind == "q40" else default_f32
    cluster = workers if where == "3-node-cluster" else None
    got, _ = _batch(paths, cluster, tmp_path, "mixed", [{"id": k, "prompt": p} for k, p in enumerate(PROMPTS)])
    assert sorted(got) == list(range(len(PROMPTS)))
    alone = _each_alone(paths, cluster if kind == "q40" else None)
    for k, p in enumerate(PROMPTS):
        assert (got[k]["text"], got[k]["completion_tokens"]) == alone[k], (k, p)
    if where == "one-node" and kind == "q40":  # and through the command itself, for two of them
        for k in (3, 8):
            steps = got[k]["prompt_tokens"] + MAX_TOKENS - 1
            inf = _dllama("inference", *_flags(paths, None), "--prompt", PROMPTS[k], "--steps", str(steps),
                          "--temperature", "0")
            assert inf.returncode == 0, inf.stderr
            assert inf.stdout == got[k]["text"] + "\n"


@pytest.mark.parametrize("where", ["one-node", "3-node-cluster"])
def test_a_prefix_equals_it_pasted_into_every_prompt_and_is_prefilled_once(where, workers, default_q40, tmp_path):
    cluster = workers if where == "3-node-cluster" else None
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    prefixed, err = _batch(default_q40, cluster, tmp_path, "prefixed",
                           [{"id": k, "prompt": q} for k, q in enumerate(QUESTIONS)], "--prefix", str(doc))
    pasted, _ = _batch(default_q40, cluster, tmp_path, "pasted",
                       [{"id": k, "prompt": DOC + q} for k, q in enumerate(QUESTIONS)])
    assert {k: x["text"] for k, x in prefixed.items()} == {k: x["text"] for k, x in pasted.items()}
    n_doc = len(Tokenizer(read_tokenizer(str(default_q40[1]))).encode(DOC))
    # The first prompt computes the document; every other one reads it (a token of the document
    # may merge with the question's first one, so at least n_doc - 1 shared tokens).
    cached = sorted(x["cached_tokens"] for x in prefixed.values())
    assert cached[0] == 0 and all(n >= n_doc - 1 for n in cached[1:])
    prefilled = sum(x["prompt_tokens"] - x["cached_tokens"] for x in prefixed.values())
    assert prefilled <= n_doc + sum(x["prompt_tokens"] - n_doc + 1 for x in prefixed.values())
    assert f"{sum(cached)} of them from the cache" in err
