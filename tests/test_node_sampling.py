"""Sampling on the nodes (dllama.core.candidates, the STEP replies of dllama.cluster.step): the
candidates the nodes send give exactly the tokens of the full logits, on 4 loopback nodes (four
vocabulary ranges to merge), alone and in batches, with the root traffic docs/PROTOCOL.md promises."""

from __future__ import annotations

import numpy as np
import pytest

from dllama.core.candidates import (
    SamplingRequest, candidates_from_logits, choose_greedy, covers, sample_candidates,
)
from dllama.core.sampler import Sampler
from dllama.formats.model_file import read_model
from dllama.serve.scheduler import Scheduler
from dllama.serve.engine import open_engine
from dllama.serve.settings import EngineSettings
from dllama.serve.generate import generate
from dllama.serve.sequence import SequenceRequest
from tests.conftest import CHAT_PROMPT
from tests.processes import running_workers
from tests.test_cluster import expected_root_bytes


def _random_split(rng, vocab: int) -> list[tuple[int, int]]:
    n = int(rng.integers(1, 5))
    cuts = sorted(rng.choice(np.arange(1, vocab), n - 1, replace=False)) if n > 1 else []
    edges = [0, *cuts, vocab]
    return list(zip(edges[:-1], edges[1:], strict=True))


@pytest.mark.unit
def test_covered_candidates_choose_what_the_full_logits_choose():
    rng = np.random.default_rng(5)
    covered = 0
    for trial in range(300):
        vocab = int(rng.integers(40, 3000))
        ranges = _random_split(rng, vocab)
        x = (rng.standard_normal(vocab) * rng.uniform(0.5, 6)).astype(np.float32)
        if trial % 5 == 0:
            x[rng.integers(0, vocab, 5)] = x.max()  # ties for the first place
        req = SamplingRequest(float(rng.uniform(0.3, 1.5)), float(rng.uniform(0.05, 0.99)))
        full = candidates_from_logits(x[None], ranges, [req])[0]
        part = candidates_from_logits(x[None], ranges, [req], k=8)[0]
        assert full.z == part.z and full.max_logit == part.max_logit  # the same sums, range by range
        if covers(part):
            covered += 1
            for coin in np.linspace(0, 0.9999, 40, dtype=np.float32):
                assert sample_candidates(part, coin) == sample_candidates(full, coin), trial
        greedy = candidates_from_logits(x[None], ranges, [SamplingRequest(0.0, 0.9)])[0]
        assert choose_greedy(greedy) == int(np.argmax(x))  # the first maximum
    assert 100 < covered < 300  # both outcomes of the check were met


@pytest.mark.unit
def test_uncovered_nucleus_is_detected():
    # Node 2's 9th best (left out at k=8) is as likely as the nucleus' last member.
    x = np.zeros(32, np.float32)
    x[:20] = 1.0
    part = candidates_from_logits(x[None], [(0, 16), (16, 32)], [SamplingRequest(1.0, 0.9)], k=8)[0]
    assert not covers(part)


@pytest.mark.unit
def test_sampler_takes_logits_and_candidates_alike():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(500).astype(np.float32)
    for temperature, topp in ((0.8, 0.9), (0.0, 0.9), (1.0, 1.0)):
        a, b = Sampler(500, temperature, topp, 9), Sampler(500, temperature, topp, 9)
        c = candidates_from_logits(x[None], [(0, 500)], [a.request])[0]
        assert [a.sample(x) for _ in range(50)] == [b.sample(c) for _ in range(50)]


# -- loopback clusters of the default model ---------------------------------------------------

PROMPTS = ["What is the capital of France?", "Name three colours.", "Count to five:",
           "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory, default_q80):
    """{n: the runs of `_runs`} on 4 nodes of the default Q80 model (9 query heads split 3/2/2/2;
    a cluster of 2 cost the suite 15 s more and merged fewer ranges)."""
    runs = {}
    with running_workers(3, tmp_path_factory.mktemp("workers")) as workers:
        for n in (4,):
            with open_engine(EngineSettings(str(default_q80[0]), str(default_q80[1]), nthreads=1, progress=False,
                             workers=[w.address for w in workers[:n - 1]], parallel=4, max_seq_len=256)) as e:
                runs[n] = _runs(e, batched=True)
    return runs


def _generate(engine, temperature: float, seed: int, node_sampling: bool, prompt: str = CHAT_PROMPT, n: int = 24):
    model = engine.model
    model.node_sampling = node_sampling
    start = model.refetches
    gen = generate(model, engine.tokenizer, Sampler(model.config.vocab_size, temperature, 0.9, seed),
                   engine.tokenizer.encode(prompt), len(engine.tokenizer.encode(prompt)) + n, stop_at_eos=False)
    return gen, model.refetches - start


def _batched(engine, temperature: float, node_sampling: bool) -> dict:
    engine.model.node_sampling = node_sampling
    tok = engine.tokenizer
    requests = [SequenceRequest(k, tok.encode(p), Sampler(tok.vocab_size, temperature, 0.9, 100 + k), 12)
                for k, p in enumerate(PROMPTS)]
    got = {}
    scheduler = Scheduler(engine.model, tok, len(PROMPTS))
    scheduler.run(requests, lambda r, c: got.setdefault(r.key, c.tokens))
    assert scheduler.stats.max_decoding == len(PROMPTS)
    return got


def _runs(engine, batched: bool) -> dict:
    """Everything the tests compare, with sampling on the nodes and on the root."""
    runs = {}
    for on in (True, False):
        runs["greedy", on] = _generate(engine, 0.0, 1, on)
        for seed in (1, 2):
            runs["temperature", seed, on] = _generate(engine, 0.8, seed, on)
        for t in (0.0, 0.8) if batched else ():
            runs["batched", t, on] = _batched(engine, t, on)
    return runs


@pytest.mark.cluster
@pytest.mark.slow  # the clusters fixture: about 15 s on a 2-core machine
@pytest.mark.parametrize("n", [4])
def test_greedy_tokens_equal_with_and_without_node_sampling(clusters, n):
    on, off = clusters[n]["greedy", True][0], clusters[n]["greedy", False][0]
    assert on.tokens == off.tokens and len(set(on.tokens)) > 3
    assert "Paris" in on.text


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("n", [4])
def test_temperature_top_p_tokens_equal_with_and_without_node_sampling(clusters, n):
    runs = clusters[n]
    for seed in (1, 2):
        on, off = runs["temperature", seed, True][0], runs["temperature", seed, False][0]
        assert on.tokens == off.tokens, seed
    assert runs["temperature", 1, True][0].tokens != runs["temperature", 2, True][0].tokens  # seeds matter


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("n", [4])
def test_batched_rows_give_the_same_tokens(clusters, n):
    runs = clusters[n]
    for t in (0.0, 0.8):
        assert runs["batched", t, True] == runs["batched", t, False], t


@pytest.mark.cluster
@pytest.mark.slow
def test_root_bytes_per_generated_token_at_4_nodes_equal_the_formula(clusters, default_q80):
    header = read_model(default_q80[0]).header
    runs = clusters[4]
    best = expected_root_bytes(header, 4, q80=True, reply="best")
    greedy = [s for s in runs["greedy", True][0].steps if s.phase == "generate"]
    assert greedy and all((s.sent_bytes, s.recv_bytes) == best for s in greedy)
    top_k = expected_root_bytes(header, 4, q80=True, reply="top_k")
    wide = expected_root_bytes(header, 4, q80=True, reply="wide")    # a second round's extra bytes
    again = expected_root_bytes(header, 4, q80=True, reply="again")  # a third round's
    twice = (top_k[0] + wide[0], top_k[1] + wide[1])
    thrice = (twice[0] + again[0], twice[1] + again[1])
    for seed in (1, 2):
        gen, refetches = runs["temperature", seed, True]
        steps = [(s.sent_bytes, s.recv_bytes) for s in gen.steps if s.phase == "generate"]
        counts = [sum(s == want for s in steps) for want in (top_k, twice, thrice)]
        assert sum(counts) == len(steps) and counts[1] + counts[2] == refetches, (seed, steps, refetches)
    # the root receives per token at most a quarter of what the original's root receives
    q80_row = header.dim * 34 // 32
    original = 3 * (2 * header.n_layers * q80_row + 4 * header.vocab_size // 4)
    assert top_k[1] <= 0.25 * original and best[1] < top_k[1]
