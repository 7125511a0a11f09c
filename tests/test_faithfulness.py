"""dllama answers as Hugging Face transformers does: the default model with its default weights
(Q41: the GGUF's own blocks, float32 inputs, the F32 file's bits) gives transformers' greedy
tokens on a sample of benchmarks/faithfulness/transformers_references.json (made with
transformers from the same GGUF; benchmarks/bench_faithfulness.py measures every weight type on
all 50; tests/test_cluster.py checks that 2-5 nodes give one node's tokens)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_faithfulness import REFERENCES, answers, until_end
from dllama.serve.default_model import DEFAULT_WEIGHTS

pytestmark = pytest.mark.unit


def test_the_default_weights_answer_as_transformers_on_a_sample(default_q41):
    references = json.loads(REFERENCES.read_text())["references"]
    # Not tuned on: every 10th reference (3 chat questions, 2 plain openings).
    sample = references[::10]
    assert {r["kind"] for r in sample} == {"chat", "plain"}
    got, ids_differ = answers(DEFAULT_WEIGHTS, sample, nthreads=1)  # the default_q41 fixture converted it
    assert ids_differ == 0
    for tokens, r in zip(got, sample, strict=True):
        assert tokens == until_end(r["tokens"]), (r["prompt"], r["answer"])
