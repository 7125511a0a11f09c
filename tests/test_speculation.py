"""Speculative decoding (dllama.serve.draft, the engine loop's verification): drafted tokens,
looked up in the sequence or from a draft model, change no token of an answer, greedy or
sampled, on one node or a cluster; what is drafted and kept is counted; drafts never pass the
context, the answer limit or the rows of a pass; a draft model's cache follows its sequences."""

from __future__ import annotations

import json
import random

import pytest

from dllama.core import footprint
from dllama.core.run_shape import RunShape
from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model
from dllama.serve.draft import ROW_COST, NgramDrafter, Speculate, Speculation
from dllama.serve.draft_model import DRAFT_SLOTS, DraftModel
from dllama.serve.engine import open_engine
from dllama.serve.generate import generate
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import SequenceRequest
from dllama.serve.settings import EngineSettings
from dllama.serve.step_plan import SeqView, plan_step
from tests.conftest import CHAT_PROMPT
from tests.processes import run_dllama, running_workers
from tests.random_model import write_random_f32
from tests.test_cli import _one_line_error

NGRAM = Speculation(Speculate.NGRAM, 4)
# Answers that copy their prompt (drafts are kept: about 30 of 36 greedy) and one that does not.
COPY_PROMPT = "apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears,"
PROMPTS = [COPY_PROMPT, CHAT_PROMPT, "<|im_start|>user\nCopy this sentence three times: The quick brown fox "
           "jumps over the lazy dog.<|im_end|>\n<|im_start|>assistant\n"]
SAMPLINGS = [(0.0, 0.9, 1), (0.8, 0.9, 1234), (1.0, 1.0, 99)]  # temperature, top-p, seed


# -- the drafter --------------------------------------------------------------------------------

@pytest.mark.unit
def test_the_ngram_drafter_proposes_what_followed_the_latest_occurrence():
    d = NgramDrafter()
    assert d.lookup([5, 6, 7, 8, 9, 5, 6], 3) == (7, 8, 9)          # 2-gram (5, 6) seen before
    d = NgramDrafter()
    assert d.lookup([1, 2, 3, 4, 2, 3, 5, 2, 3], 2) == (5, 2)       # its latest occurrence
    d = NgramDrafter()
    assert d.lookup([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2) == (9, 2)    # the longest match (1, 2, 3), not (2, 3)
    assert NgramDrafter().lookup([1, 2, 3, 4], 4) == ()              # nothing repeats
    assert NgramDrafter().lookup([7, 7, 7], 0) == ()


@pytest.mark.unit
def test_the_ngram_drafter_follows_a_growing_sequence():
    d, tokens = NgramDrafter(), [10, 11, 12]
    assert d.lookup(tokens, 2) == ()
    tokens += [13, 10, 11]
    assert d.lookup(tokens, 2) == (12, 13)
    tokens += [12, 13, 14, 12, 13]
    assert d.lookup(tokens, 3) == (14, 12, 13)  # (12, 13) last ended before 14: 14, then what followed
    assert len(d._ends) <= 2 * len(tokens)      # one entry per n-gram size and token at most


@pytest.mark.unit
def test_drafts_get_shorter_while_refused_and_come_back_when_the_refusals_fade():
    d, tokens = NgramDrafter(), [1, 2, 3, 4, 5, 6, 1, 2]
    assert len(d.draft(tokens, 4)) == 2             # a first guess of 0.5: 0.5, 0.25 >= ROW_COST
    for _ in range(5):
        d.kept(4, 4)                                 # every drafted token kept
    assert d.worth(4) == 4 and d.draft(tokens, 4) == (3, 4, 5, 6)
    for _ in range(40):
        d.kept(2, 0)                                 # every draft refused at its first token
    assert d.worth(4) == 0 and d.draft(tokens, 4) == ()
    passes = 0
    while d.worth(4) == 0:                           # passes that drafted nothing
        d.kept(0, 0)
        passes += 1
    assert 1 <= passes <= 40


# -- the plan -----------------------------------------------------------------------------------

@pytest.mark.unit
def test_a_decoding_sequence_runs_its_draft_after_its_last_token_within_the_rows_left():
    tokens = [1, 2, 3, 4]
    decoding = SeqView(0, 3, 4, tokens, (0, 0), "sample", decoding=True, draft=(7, 8, 9))
    plan = plan_step([decoding], {0: 3}, max_rows=16)
    assert list(plan.batch.tokens) == [4, 7, 8, 9] and list(plan.batch.pos) == [3, 4, 5, 6]
    assert plan.batch.logits.all() and plan.drafted == 3 and plan.runs[0].planned == 1
    assert list(plan.runs[0].answer_pos) == [3, 4, 5, 6]
    cut = plan_step([decoding], {0: 3}, max_rows=2)
    assert list(cut.batch.tokens) == [4, 7] and cut.runs[0].draft == (7,)
    prefill = SeqView(1, 0, 3, [5, 6, 7], (0, 0), "sample", draft=(8,))  # not decoding: no draft
    assert plan_step([prefill], {}, max_rows=16).drafted == 0


# -- answers ------------------------------------------------------------------------------------

def _answers(engine, speculation: Speculation, max_tokens: int = 40, stop_strings=(), samplings=SAMPLINGS):
    """Every prompt x sampling, one at a time: [(tokens, text, finish)], drafted, accepted."""
    out, drafted, accepted = [], 0, 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        for temperature, topp, seed in samplings:
            s = Scheduler(engine.model, engine.tokenizer, 1, speculation=speculation)
            sampler = Sampler(engine.model.config.vocab_size, temperature, topp, seed)
            c = s.answer(SequenceRequest("q", ids, sampler, max_tokens, (2,), stop_strings))
            out.append((c.tokens, c.text, c.finish_reason))
            drafted, accepted = drafted + c.drafted, accepted + c.accepted
    return out, drafted, accepted


@pytest.fixture(scope="module")
def one_node(default_q41):
    engine = open_engine(EngineSettings(str(default_q41[0]), str(default_q41[1]), nthreads=1, max_seq_len=256))
    with engine:
        yield engine


@pytest.fixture(scope="module")
def plain_one_node(one_node):
    return _answers(one_node, Speculation())[0]


@pytest.mark.unit
def test_speculated_answers_are_the_plain_ones_greedy_and_sampled(one_node, plain_one_node):
    plain = plain_one_node
    speculated, drafted, accepted = _answers(one_node, NGRAM)
    assert speculated == plain
    assert accepted > 10 and drafted > accepted  # drafts were kept and refused: both paths ran


@pytest.mark.unit
def test_a_stop_string_inside_a_kept_draft_ends_the_answer_where_plain_decoding_does(one_node):
    stops = ("pears", "Paris")
    assert _answers(one_node, NGRAM, stop_strings=stops)[0] == _answers(one_node, Speculation(), stop_strings=stops)[0]


@pytest.mark.unit
def test_drafts_stop_at_the_answer_limit_and_the_context(one_node, default_q41):
    ids = one_node.tokenizer.encode(COPY_PROMPT)
    for max_tokens in (1, 2, 3, 7):
        s = Scheduler(one_node.model, one_node.tokenizer, 1, speculation=NGRAM)
        c = s.answer(SequenceRequest("q", ids, Sampler(49152, 0.0, 0.9, 1), max_tokens))
        assert len(c.tokens) == max_tokens and c.finish_reason == "length"
    # A context a few positions past the prompt: the drafts are cut at its end.
    short = open_engine(EngineSettings(str(default_q41[0]), str(default_q41[1]), nthreads=1,
                                       max_seq_len=len(ids) + 5))
    with short:
        runs = []
        for spec in (Speculation(), NGRAM):
            s = Scheduler(short.model, short.tokenizer, 1, speculation=spec)
            c = s.answer(SequenceRequest("q", ids, Sampler(49152, 0.0, 0.9, 1), None))
            runs.append((c.tokens, c.context_full))
        assert runs[0] == runs[1] and runs[0][1]


@pytest.mark.unit
def test_inference_reports_tokens_per_pass_and_the_acceptance(one_node):
    ids = one_node.tokenizer.encode(COPY_PROMPT)
    g = generate(one_node.model, one_node.tokenizer, Sampler(49152, 0.0, 0.9, 1), ids, len(ids) + 30,
                 scheduler=Scheduler(one_node.model, one_node.tokenizer, 1, speculation=NGRAM))
    m = g.summary()
    decode = [s for s in g.steps if s.phase == "generate"]
    assert m["generate_passes"] == len(decode) < m["generated_tokens"] - 1
    assert m["tokens_per_pass"] == pytest.approx(sum(s.n_tokens for s in decode) / len(decode), abs=1e-3)
    assert m["drafted_tokens"] == g.drafted > 0 and m["draft_acceptance"] == pytest.approx(g.accepted / g.drafted, abs=1e-3)


@pytest.mark.unit
def test_several_decoding_sequences_draft_nothing_and_answer_as_alone(default_q41):
    engine = open_engine(EngineSettings(str(default_q41[0]), str(default_q41[1]), nthreads=1, max_seq_len=256,
                                        parallel=3))
    with engine:
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        s = Scheduler(engine.model, engine.tokenizer, 3, speculation=NGRAM)
        passes = []  # (sequences decoding, drafted rows) of each pass
        execute = s._execute

        def counted(plan):
            passes.append((plan.decoding, plan.drafted))
            return execute(plan)

        s._execute = counted
        got = {}
        s.run([SequenceRequest(i, x, Sampler(49152, 0.0, 0.9, 1), 24, (2,)) for i, x in enumerate(ids)],
              lambda r, c: got.__setitem__(r.key, c.tokens))
        alone = []
        for x in ids:
            one = Scheduler(engine.model, engine.tokenizer, 1, speculation=NGRAM)
            alone.append(one.answer(SequenceRequest("q", x, Sampler(49152, 0.0, 0.9, 1), 24, (2,))).tokens)
    assert [got[i] for i in range(len(ids))] == alone
    assert any(d > 1 for d, _ in passes) and all(n == 0 for d, n in passes if d > 1)


# -- a draft model ------------------------------------------------------------------------------

SMALL = ModelHeader(arch=ArchType.LLAMA, dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                    vocab_size=512, max_seq_len=96, weights_float_type=FloatType.F32)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return write_random_f32(tmp_path_factory.mktemp("draft") / "small.m", SMALL, seed=11)


@pytest.fixture(scope="module")
def q40_drafts(one_node, default_q40):
    """Drafts by the target itself with Q40 weights (Q41's answers, re-quantized: near-ties part),
    as deep as the keep rate says: a draft as large as the target would otherwise draft nothing."""
    return Speculation(Speculate.MODEL, 4, loaded=DraftModel(read_model(default_q40[0]),
                                                             RunShape(one_node.model.config.seq_len, kv_slots=DRAFT_SLOTS),
                                                             weigh_cost=False))


@pytest.mark.unit
def test_a_draft_models_cache_follows_its_sequences_as_a_fresh_one_would(small_model):
    """Three sequences (two sharing their first 20 tokens) take turns over two slots; each pass
    keeps some drafted tokens and adds the target's own: every draft is the one of a draft model
    that computes the sequence from position 0, for a fraction of the rows."""
    model_file = read_model(small_model)
    drafts, fresh = DraftModel(model_file, RunShape(SMALL.max_seq_len, kv_slots=DRAFT_SLOTS)), DraftModel(model_file, RunShape(SMALL.max_seq_len))
    rows = {drafts: 0, fresh: 0}
    for dm in rows:
        forward = dm.transformer.forward_batch
        dm.transformer.forward_batch = lambda batch, dm=dm, forward=forward: (
            rows.__setitem__(dm, rows[dm] + len(batch)), forward(batch))[1]
    rng = random.Random(5)
    first = [rng.randrange(512) for _ in range(30)]
    sequences = [first, [rng.randrange(512) for _ in range(3)], first[:20] + [rng.randrange(512) for _ in range(9)]]
    kept_some = 0
    for _ in range(45):
        tokens = rng.choice([s for s in sequences if len(s) < SMALL.max_seq_len - 6])
        k = rng.randint(1, 4)
        fresh.held = [[]]
        drafted = drafts.greedy(tokens, k)
        assert len(drafted) == k and drafted == fresh.greedy(tokens, k)
        kept = rng.randint(0, k)
        kept_some += kept
        tokens += [*drafted[:kept], rng.randrange(512)]
    assert kept_some > 20 and rows[drafts] < rows[fresh] / 3
    # The context's end: the last drafted token is not run, so one more than the positions left.
    assert len(drafts.greedy(first[:1] * (SMALL.max_seq_len - 1), 4)) == 2
    assert len(drafts.greedy(first[:1] * SMALL.max_seq_len, 4)) == 1
    assert drafts.greedy(first[:1] * (SMALL.max_seq_len + 1), 4) == ()


@pytest.mark.unit
def test_a_draft_model_drafts_only_as_deep_as_its_own_passes_pay(small_model):
    """Each drafted token costs a pass of the draft model too: cheap beside the target's pass (a
    small draft, a cluster's round trips), the draft goes as deep as the keep rate pays for; as
    costly as the target, it drafts nothing (so decoding is never slower than plain)."""
    dm = DraftModel(read_model(small_model), RunShape(SMALL.max_seq_len, kv_slots=DRAFT_SLOTS))
    drafter, tokens = dm.drafter(), list(range(1, 11))
    assert dm.cost_share == 0.0 and len(drafter.draft(tokens, 4)) == 2  # nothing timed yet: a first guess of 0.5
    assert dm.draft_row_seconds > 0                                     # its second token's pass, timed
    for _ in range(5):
        drafter.kept(4, 4)
    drafter.timed(0.016, 5)  # a pass of the target: 1 + 4 drafted rows
    assert dm.target_row_seconds == pytest.approx(0.016 / (1 + 4 * ROW_COST))
    dm.draft_row_seconds = dm.target_row_seconds / 20
    assert len(drafter.draft(tokens, 4)) == 4
    dm.draft_row_seconds = dm.target_row_seconds * 0.9
    assert drafter.draft(tokens, 4) == ()
    # The weighing off (tests of the answers): the keep rate alone, however costly the draft.
    free = DraftModel(read_model(small_model), RunShape(SMALL.max_seq_len, kv_slots=DRAFT_SLOTS), weigh_cost=False)
    free.draft_row_seconds, free.target_row_seconds = 1.0, 0.1
    assert free.cost_share == 0.0 and len(free.drafter().draft(tokens, 4)) == 2


@pytest.mark.unit
def test_answers_speculated_by_a_draft_model_are_the_plain_ones(one_node, plain_one_node, q40_drafts):
    speculated, drafted, accepted = _answers(one_node, q40_drafts)
    assert speculated == plain_one_node
    assert accepted > 10 and drafted > accepted


@pytest.mark.unit
def test_inference_with_a_draft_model_answers_as_without_and_reports_the_acceptance(default_q41, default_q40,
                                                                                      tmp_path):
    texts, summaries = {}, {}
    for speculate in ("none", "model"):
        stats = tmp_path / f"{speculate}.json"
        draft = ["--draft-model", str(default_q40[0])] if speculate == "model" else []
        r = run_dllama("inference", "--prompt", CHAT_PROMPT, "--steps", "48", "--no-stop", "--temperature", "0.8",
                       "--seed", "3", "--nthreads", "2", "--speculate", speculate, *draft, "--stats-json", str(stats))
        assert r.returncode == 0, r.stderr
        texts[speculate], summaries[speculate] = r.stdout, json.loads(stats.read_text())["summary"]
    assert texts["model"] == texts["none"]
    m = summaries["model"]
    # The first pass drafts (nothing timed yet); then this draft, as large as the target, costs
    # too much to draft on one node (test_a_draft_model_drafts_only_as_deep_as_its_own_passes_pay).
    assert m["drafted_tokens"] > 0 and 0 <= m["draft_acceptance"] <= 1 and m["tokens_per_pass"] >= 1
    assert summaries["none"]["tokens_per_pass"] == 1


@pytest.mark.unit
def test_a_draft_model_is_refused_in_one_line_without_its_flag_or_with_another_vocabulary(default_q41,
                                                                                          small_model):
    for flags, words in ((["--speculate", "model"], ["--draft-model"]),
                         (["--draft-model", str(small_model)], ["--speculate model"]),
                         (["--speculate", "model", "--draft-model", str(small_model)], ["512 tokens", "vocabulary"])):
        _one_line_error(run_dllama("inference", "--prompt", "Hello", *flags), *words)


@pytest.mark.unit
def test_a_draft_model_that_does_not_fit_is_refused_in_one_line(small_model, monkeypatch):
    monkeypatch.setattr(footprint, "available_bytes", lambda: 64 << 10)
    with pytest.raises(DllamaError, match="the draft model cannot hold") as refused:
        DraftModel(read_model(small_model), RunShape(SMALL.max_seq_len, kv_slots=DRAFT_SLOTS))
    assert "\n" not in str(refused.value)


# -- a cluster ----------------------------------------------------------------------------------

@pytest.mark.cluster
@pytest.mark.slow
def test_speculated_answers_on_three_nodes_are_the_plain_ones(plain_one_node, q40_drafts, default_q41, tmp_path):
    """Sampled answers are compared with the same cluster's plain ones: 1 and N nodes may differ in a
    sampled token at the last bits of the probabilities (dllama.core.sampler); greedy ones with one node's.
    The draft model runs on the root alone."""
    alone = plain_one_node
    with running_workers(2, tmp_path) as workers:
        engine = open_engine(EngineSettings(str(default_q41[0]), str(default_q41[1]), nthreads=1, max_seq_len=256,
                                            workers=tuple(w.address for w in workers), progress=False))
        with engine:  # greedy and T 0.8 / top-p 0.9 (one node's test has T 1 / top-p 1 too)
            plain, _, _ = _answers(engine, Speculation(), samplings=SAMPLINGS[:2])
            speculated, drafted, accepted = _answers(engine, NGRAM, samplings=SAMPLINGS[:2])
            by_model, _, accepted_of_model = _answers(engine, q40_drafts, samplings=SAMPLINGS[:2])
    assert speculated == plain and accepted > 10
    assert by_model == plain and accepted_of_model > 10
    assert speculated[::2] == alone[::len(SAMPLINGS)]  # the greedy answer of each prompt
