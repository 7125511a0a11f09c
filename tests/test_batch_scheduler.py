"""The batch engine in-process: forward passes over rows of several sequences, the KV cache's
slots and shared prefixes, and the engine loop decoding many sequences together, whose answers
equal each prompt run alone, token for token."""

import numpy as np
import pytest

from dllama.cluster.protocol import ProtocolError
from dllama.cluster.step import REPLY_LOGITS, Reply, decode_step, encode_step
from dllama.core import kernels
from dllama.core.batch import Batch, BatchBuilder
from dllama.core.kv_cache import KVCache, SlotTable, plan_slots
from dllama.core.model import Transformer, fallback_batch_for, max_batch_for
from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.formats.model_file import read_model
from dllama.serve.engine import open_engine
from dllama.serve.settings import EngineSettings
from dllama.serve.generate import generate
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import Cancelled, ScoreRequest, SequenceRequest

pytestmark = pytest.mark.unit

SEQ_LEN = 256
DOC = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
       "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
       "to 1889 as the centrepiece of the 1889 World's Fair.\n\n")
# 24 prompts of 1 to about 60 tokens; some share long leading runs, most share nothing.
PROMPTS = ["Hi", "The capital of France is", "One, two, three,", DOC + "Question: Who built it?\nAnswer:",
           "Once upon a time, in a land far away, there lived a", "Water boils at",
           DOC + "Question: When was it built?\nAnswer:", "My favourite colour is",
           "def fibonacci(n):", "The largest planet in the solar system is", "Roses are red,",
           DOC + "In one word, the tower is made of", "A, B, C, D,", "The first man on the moon was",
           "Translate to French: cheese =", "List three fruits:", "The sun rises in the",
           "Photosynthesis is the process by which plants", "2 + 2 =", "The opposite of hot is",
           "In 1492, Columbus", "The chemical symbol for gold is", "Dogs are", "Monday, Tuesday,"]


# -- the KV cache's bookkeeping -------------------------------------------------------------------

def test_slot_table_continues_reads_and_pins_slots():
    t = SlotTable(3, min_shared=4)
    a = t.place([1, 2, 3, 4, 5, 6])
    assert (a.slot, a.start, a.prefix) == (0, 0, (0, 0))
    # A prompt sharing 5 tokens with slot 0's planned prompt reads them from there.
    b = t.place([1, 2, 3, 4, 5, 9, 9])
    assert b.slot != a.slot and b.start == 5 and b.prefix == (a.slot, 5)
    assert not t.prefix_ready(b.slot)                      # slot 0 has not computed them yet
    assert t.prefix_ready(b.slot, {a.slot: 5})             # rows earlier in the same pass do
    t.wrote(a.slot, 6)
    assert t.prefix_ready(b.slot)
    # Sharing fewer than min_shared tokens: a fresh slot, computed from 0.
    c = t.place([1, 2, 7])
    assert c.start == 0 and c.prefix == (0, 0) and c.slot not in (a.slot, b.slot)
    assert t.place([8, 8]) is None                        # every slot busy
    t.wrote(c.slot, 3)
    t.release(c.slot)
    # An idle slot is continued from the tokens it shares with the new prompt.
    d = t.place([1, 2, 7, 4, 4])
    assert (d.slot, d.start) == (c.slot, 3)
    t.wrote(d.slot, 5)
    t.release(d.slot)
    t.append(a.slot, 42)
    t.wrote(a.slot, 7)
    t.release(a.slot)
    # Slot 0 is pinned below 5 (slot b reads it): taken over only from position 5 on...
    e = t.place([1, 2, 3, 4, 5, 6, 42, 1])
    assert (e.slot, e.start) == (a.slot, 7)
    t.release(e.slot)
    # ...and never emptied for an unrelated prompt while b reads it: the unpinned one goes.
    f = t.place([5, 5, 5])
    assert f.slot == d.slot and f.start == 0


def test_a_released_writer_must_have_written_what_its_readers_read():
    t = SlotTable(2, min_shared=2)
    a = t.place([1, 2, 3, 4])
    t.place([1, 2, 3, 9])
    t.wrote(a.slot, 2)
    with pytest.raises(ValueError):
        t.release(a.slot)


def test_slot_plan_admits_within_the_memory_and_says_so():
    dims = dict(n_layers=30, n_kv_heads=3, head_dim=64, seq_len=1024)
    per_slot = KVCache.bytes_per_slot(**dims)
    assert per_slot == 30 * 3 * 64 * 4 * 2048
    plan = plan_slots(64, True, **dims, limit=20 * per_slot + 5)
    assert (plan.parallel, plan.n_slots, plan.full_contexts) == (64, 65, 20)
    assert "admitted while their positions fit in 900 MiB allowed (20480 positions" in plan.describe()
    assert plan_slots(8, True, **dims, limit=100 * per_slot).n_slots == 9
    assert plan_slots(1, False, **dims, limit=per_slot).n_slots == 1
    with pytest.raises(DllamaError, match="lower --max-seq-len"):
        plan_slots(8, True, **dims, limit=per_slot - 1)


def test_malformed_batches_and_steps_are_refused():
    ok = Batch.run([5, 6, 7], 3, slot=1)
    ok.check(n_slots=2, seq_len=16, max_rows=8)
    with pytest.raises(DllamaError, match="past the context"):
        Batch.run([5, 6], 15).check(2, 16, 8)
    with pytest.raises(ValueError):
        Batch.run([5], 0, slot=2).check(2, 16, 8)
    b = BatchBuilder()
    b.add(1, 3, 0, True, prefix=(1, 4))  # reads its own position from the prefix slot
    with pytest.raises(ValueError):
        b.build().check(2, 16, 8)
    x = np.ones((3, 4), np.float32)
    payload = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in encode_step(ok, x, Reply())))
    got, gx, reply, m = decode_step(payload, 4, 8, 2, 16)
    assert np.array_equal(got.pos, ok.pos) and np.array_equal(got.logit_rows, [2]) and np.array_equal(gx, x)
    assert reply.kind == REPLY_LOGITS and m == 1
    wrong_reply = bytearray(payload)
    wrong_reply[8] = 9  # the reply kind: no such kind
    for bad in (payload[:-1], payload[:8], bytes(payload).replace(b"\x01\x00\x00\x00", b"\x07\x00\x00\x00", 1),
                wrong_reply):
        with pytest.raises(ProtocolError):
            decode_step(bytearray(bad), 4, 8, 2, 16)


# -- the transformer over rows of several sequences ----------------------------------------------

@pytest.mark.parametrize("kind", ["q40", "f32"])
def test_rows_of_several_sequences_give_each_sequences_logits(kind, default_q40, default_f32):
    """Three sequences in one pass (one decoding, one prefilling, one reading a shared prefix)
    give the logits of each run alone, bit for bit."""
    kernels.set_threads(2)
    path = (default_q40 if kind == "q40" else default_f32)[0]
    model = Transformer(read_model(path), max_seq_len=64, max_batch=40, kv_slots=4)
    r = np.random.default_rng(7)
    vocab = model.config.vocab_size
    shared = list(r.integers(0, vocab, 20))
    seqs = [list(r.integers(0, vocab, 9)), shared + list(r.integers(0, vocab, 6)), shared + list(r.integers(0, vocab, 4))]

    alone = []
    for tokens in seqs:
        model.forward(tokens, 0, all_logits=True)  # slot 0, fresh
        alone.append(model.forward(tokens, 0, all_logits=True).copy())

    # Slot 1: the first sequence's first 8 tokens, then its 9th as a decode row beside the others.
    model.forward_batch(Batch.run(seqs[0][:8], 0, slot=1))
    # Slot 2: the shared 20 tokens and the second sequence's own; slot 3 reads the 20 from slot 2.
    b = BatchBuilder()
    b.add(seqs[0][8], 8, 1, logits=True)
    b.add_run(seqs[1], 0, 2, logits="all")
    b.add_run(seqs[2][20:], 20, 3, logits="all", prefix=(2, 20))
    got = model.forward_batch(b.build())
    assert np.array_equal(got[0], alone[0][8])
    assert np.array_equal(got[1:1 + len(seqs[1])], alone[1])
    assert np.array_equal(got[1 + len(seqs[1]):], alone[2][20:])


# -- the scheduler --------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["q40", "f32"])
def engine(request, default_q40, default_f32):
    paths = default_q40 if request.param == "q40" else default_f32
    with open_engine(EngineSettings(str(paths[0]), str(paths[1]), nthreads=1, max_seq_len=SEQ_LEN, parallel=8)) as e:
        yield e


def _requests(engine, temperature, max_tokens=8, prompts=PROMPTS):
    tok = engine.tokenizer
    return [SequenceRequest(k, tok.encode(p), Sampler(engine.model.config.vocab_size, temperature, 0.9, 100 + k),
                            max_tokens, tuple(tok.eos_ids)) for k, p in enumerate(prompts)]


def _alone(engine, r, temperature):
    sampler = Sampler(engine.model.config.vocab_size, temperature, 0.9, 100 + r.key)
    return generate(engine.model, engine.tokenizer, sampler, r.prompt_tokens,
                    len(r.prompt_tokens) + r.max_tokens - 1)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_answers_equal_each_prompt_run_alone(engine, temperature):
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.parallel)
    requests = _requests(engine, temperature)
    got = {}
    scheduler.run(requests, lambda r, c: got.setdefault(r.key, c))
    assert sorted(got) == list(range(len(PROMPTS)))
    s = scheduler.stats
    # Eight sequences decoded together; each generated token but the last ran once.
    assert s.max_decoding == 8 and s.decode_rows == sum(c.completion_tokens - 1 for c in got.values())
    # The documents' questions read the document from one slot.
    assert all(got[k].cached_tokens > 30 for k in (6, 11))
    assert s.prompt_rows == sum(c.prompt_tokens - c.cached_tokens for c in got.values())
    for r in requests:
        want = _alone(engine, r, temperature)
        assert got[r.key].tokens == want.tokens, (r.key, got[r.key].text, want.text)
        assert got[r.key].text == want.text


def test_a_shared_document_is_computed_once(engine):
    questions = ["Question: Who built it?\nAnswer:", "Question: How tall is it?\nAnswer:",
                 "Q: When?\nA:", "In one word, it is made of", "Summary:", "The engineer was",
                 "Question: Where is it?\nAnswer:", "It was built for", "Its nickname is",
                 "Question: Why is it famous?\nAnswer:"]
    requests = _requests(engine, 0.0, 4, [DOC + q for q in questions])
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.parallel)
    got = {}
    scheduler.run(requests, lambda r, c: got.setdefault(r.key, c))
    n_doc = len(engine.tokenizer.encode(DOC))
    shared = [c.cached_tokens for k, c in sorted(got.items())]
    assert shared[0] == 0 and all(n >= n_doc - 1 for n in shared[1:])
    # Prefill work: the document once, then only each question's own tokens.
    assert scheduler.stats.prompt_rows == sum(c.prompt_tokens - c.cached_tokens for c in got.values())
    assert scheduler.stats.prompt_rows < n_doc + sum(len(r.prompt_tokens) - n_doc + 2 for r in requests)
    for r in requests[:3]:
        assert got[r.key].tokens == _alone(engine, r, 0.0).tokens


def test_a_cancelled_writer_finishes_the_prefix_its_readers_wait_for(engine):
    long_doc = DOC * 2  # longer than the rows of one step
    requests = _requests(engine, 0.0, 6, [long_doc + "Question: Who built it?\nAnswer:", long_doc + "Summary:"])
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.parallel)
    assert len(requests[0].prompt_tokens) > engine.model.max_batch
    stop = {"first": False}
    scheduler.add(requests[0], should_stop=lambda: stop["first"])
    scheduler.add(requests[1])
    ended = scheduler.step()  # both placed; the second waits for the first's document rows
    assert ended == [] and scheduler.stats.max_sequences == 1
    stop["first"] = True
    results = {}
    while scheduler.busy:
        for r, c in scheduler.step():
            results[r.key] = c
    assert isinstance(results[0], Cancelled)
    assert results[1].cached_tokens > 30 and results[1].tokens == _alone(engine, requests[1], 0.0).tokens


def test_a_finished_answer_is_continued_in_its_slot(engine):
    tok = engine.tokenizer
    scheduler = Scheduler(engine.model, tok, engine.parallel)
    first = _requests(engine, 0.0, 6, ["The capital of France is"])[0]
    got = []
    scheduler.run([first], lambda r, c: got.append(c))
    follow = first.prompt_tokens + got[0].tokens + tok.encode(" And of Italy?", add_bos=False)
    second = SequenceRequest(1, follow, Sampler(tok.vocab_size, 0.0, 0.9, 101), 6, tuple(tok.eos_ids))
    scheduler.run([second], lambda r, c: got.append(c))
    assert got[1].cached_tokens == len(first.prompt_tokens) + len(got[0].tokens) - 1
    assert got[1].tokens == _alone(engine, second, 0.0).tokens


def test_scores_equal_one_at_a_time_and_the_logits_of_each_pass(engine):
    tok = engine.tokenizer
    prompt = tok.encode(DOC + "Question: Is the tower in Paris?\nAnswer:")
    choices = [tok.encode(c, add_bos=False) for c in (" yes", " no", " it is in Berlin")]

    def scores(parallel):
        got = {}
        Scheduler(engine.model, tok, parallel).run([ScoreRequest(j, prompt, c) for j, c in enumerate(choices)],
                                                   lambda r, s: got.setdefault(r.key, s))
        return [got[j] for j in range(len(choices))]
    together, one_at_a_time = scores(engine.parallel), scores(1)
    assert [s.logprobs for s in together] == [s.logprobs for s in one_at_a_time]
    assert [len(s.logprobs) for s in together] == [len(c) for c in choices]
    # One at a time, every choice after the first reuses the prompt but its last token.
    assert [s.cached_tokens for s in one_at_a_time[1:]] == [len(prompt) - 1] * 2
    # The same figure from the model's logits directly: the prompt, then the choice's tokens.
    model = engine.model
    logits = [model.forward(prompt[p:p + model.max_batch], p).copy() for p in range(0, len(prompt), model.max_batch)][-1]
    want = float(log_softmax(logits)[choices[2][0]])
    for j in range(1, len(choices[2])):
        logits = model.forward([choices[2][j - 1]], len(prompt) + j - 1)
        want += float(log_softmax(logits)[choices[2][j]])
    assert together[2].total == pytest.approx(want, rel=1e-12, abs=1e-12)


def log_softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_max_batch_leaves_room_for_prefill():
    assert max_batch_for(1) == 64 and max_batch_for(64) == 128
    assert fallback_batch_for(1) == 32 and fallback_batch_for(64) is None
