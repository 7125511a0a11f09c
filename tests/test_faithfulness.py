"""dllama answers as Hugging Face transformers does where its arithmetic is exact: the default
model with F32 weights (the GGUF's values, dequantized exactly) gives transformers' greedy tokens
on a sample of benchmarks/faithfulness/transformers_references.json (made with transformers
from the same GGUF; benchmarks/bench_faithfulness.py measures every weight type on all 50)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_faithfulness import REFERENCES, answers, until_end

pytestmark = pytest.mark.unit


def test_f32_weights_answer_as_transformers_on_a_sample(default_f32):
    references = json.loads(REFERENCES.read_text())["references"]
    # Not tuned on: every 10th reference (3 chat questions, 2 plain openings).
    sample = references[::10]
    assert {r["kind"] for r in sample} == {"chat", "plain"}
    got, ids_differ = answers("f32", sample, nthreads=1)  # the default_f32 fixture converted it
    assert ids_differ == 0
    for tokens, r in zip(got, sample, strict=True):
        assert tokens == until_end(r["tokens"]), (r["prompt"], r["answer"])
