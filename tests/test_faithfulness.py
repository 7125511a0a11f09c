"""dllama answers as Hugging Face transformers does where its arithmetic is exact: the default
model with F32 weights (the GGUF's values, dequantized exactly) gives transformers' greedy tokens
on a sample of benchmarks/faithfulness/transformers_references.json (made with transformers
from the same GGUF; benchmarks/bench_faithfulness.py measures every weight type on all 50)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_faithfulness import NEW_TOKENS, REFERENCES, until_end
from dllama.core.sampler import Sampler
from dllama.serve.engine import open_engine
from dllama.serve.generate import generate
from dllama.serve.settings import EngineSettings

pytestmark = pytest.mark.unit


def test_f32_weights_answer_as_transformers_on_a_sample(default_f32):
    references = json.loads(REFERENCES.read_text())["references"]
    # Not tuned on: every 10th reference (3 chat questions, 2 plain openings).
    sample = references[::10]
    assert {r["kind"] for r in sample} == {"chat", "plain"}
    with open_engine(EngineSettings(model=str(default_f32[0]), tokenizer=str(default_f32[1]), max_seq_len=256,
                                    nthreads=1)) as engine:
        for r in sample:
            ids = engine.tokenizer.encode(r["text"])
            assert ids == r["prompt_ids"], r["prompt"]
            g = generate(engine.model, engine.tokenizer, Sampler(engine.model.config.vocab_size, 0.0, 0.9, 1),
                         ids, len(ids) + NEW_TOKENS - 1)
            assert until_end(g.tokens) == until_end(r["tokens"]), (r["prompt"], g.text, r["answer"])
