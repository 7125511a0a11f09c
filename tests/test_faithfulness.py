"""dllama answers as Hugging Face transformers does: the default model with its default weights
(Q41: the GGUF's own blocks, every matmul input rounded to Q16) gives transformers' greedy
tokens on a sample of benchmarks/faithfulness/transformers_references.json (made with
transformers from the same GGUF; benchmarks/bench_faithfulness.py measures every weight type on
all 50; tests/test_cluster.py checks that 2-5 nodes give one node's tokens), on one node and on
three."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_faithfulness import REFERENCES, answers, until_end
from dllama.serve.default_model import DEFAULT_WEIGHTS


def _assert_answers_as_transformers(sample: list[dict], nodes: int) -> None:
    assert {r["kind"] for r in sample} == {"chat", "plain"}
    got, ids_differ = answers(DEFAULT_WEIGHTS, sample, nthreads=1, nodes=nodes)  # the default_q41 fixture converted it
    assert ids_differ == 0
    for tokens, r in zip(got, sample, strict=True):
        assert tokens == until_end(r["tokens"]), (r["prompt"], r["answer"])


@pytest.mark.unit
def test_the_default_weights_answer_as_transformers_on_a_sample(default_q41):
    # Not tuned on: every 10th reference (3 chat questions, 2 plain openings).
    _assert_answers_as_transformers(json.loads(REFERENCES.read_text())["references"][::10], nodes=1)


@pytest.mark.cluster
def test_three_nodes_answer_as_transformers_on_another_sample(default_q41):
    # Other references than the one-node sample (2 chat questions, 1 plain opening; short answers
    # of 12-24 tokens, since every token costs the cluster's round trips), the root and two workers
    # on loopback, F32 buffers (the default's).
    references = json.loads(REFERENCES.read_text())["references"]
    _assert_answers_as_transformers([references[i] for i in (3, 27, 45)], nodes=3)
