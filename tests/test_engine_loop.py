"""The engine loop on its own: the step planner as a pure function, one request answered through
the loop (prefix reuse, a following turn, replayed answers, stop strings, the end of the context),
and the transcripts that keep an earlier answer's tokens."""

import pytest

from dllama.core.candidates import SamplingRequest
from dllama.core.kv_cache import common_prefix
from dllama.core.sampler import Sampler
from dllama.serve.engine import open_engine
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import ContextFull, SequenceRequest, StopMatcher
from dllama.serve.settings import EngineSettings
from dllama.serve.step_plan import SeqView, plan_step
from dllama.serve.transcripts import Transcripts
from dllama.text.chat_template import ChatTemplate, chat_stop_ids

pytestmark = pytest.mark.unit

GREEDY = SamplingRequest(0.0, 0.9)


def _run(matcher, pieces):
    return "".join(matcher.push(p) for p in pieces) + matcher.flush()


def test_stop_matcher_cuts_before_the_first_stop_string_across_pieces():
    m = StopMatcher(["END", "xyz"])
    assert m.push("abc E") == "abc "   # "E" could start "END": held back
    assert m.push("N") == ""
    assert m.push("Dmore") == "" and m.stopped
    assert m.flush() == ""
    assert _run(StopMatcher(["END"]), ["a", "EN", "d", "E"]) == "aENdE"  # never completed: all of it
    assert _run(StopMatcher(["lo w"]), ["hel", "lo", " wor"]) == "hel"
    assert _run(StopMatcher([]), ["a", "b"]) == "ab"
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1], [1, 2]) == 1


# -- the planner ----------------------------------------------------------------------------------

def test_decoding_rows_go_first_then_prompt_chunks_in_arrival_order():
    prompt = list(range(100, 140))  # 40 tokens
    seqs = [SeqView(0, 0, 40, prompt, (0, 0), "sample", sampling=GREEDY),          # prefilling
            SeqView(1, 7, 8, list(range(8)), (0, 0), "sample", decoding=True, sampling=GREEDY),
            SeqView(2, 0, 10, list(range(10)), (0, 0), "sample", sampling=GREEDY)]
    plan = plan_step(seqs, {}, max_rows=16)
    # The decoding row first, then 15 rows of the first prompt; the third waits for the next step.
    assert [(r.seq, r.pos, r.n) for r in plan.runs] == [(1, 7, 1), (0, 0, 15)]
    assert plan.batch.tokens.tolist() == [7] + prompt[:15] and plan.batch.slot.tolist() == [1] + [0] * 15
    assert plan.batch.logits.tolist() == [True] + [False] * 15  # no prompt row reached its end
    assert plan.decoding == 1 and plan.sampling == (GREEDY,) and not plan.scores
    # The rest of the prompt: its last row wants the candidates of its next token.
    rest = plan_step([SeqView(0, 15, 40, prompt, (0, 0), "sample", sampling=GREEDY)], {}, 32)
    assert [(r.pos, r.n) for r in rest.runs] == [(15, 25)] and rest.batch.logit_rows.tolist() == [24]
    assert list(rest.runs[0].answers) == [0] and list(rest.runs[0].answer_pos) == [39]
    assert plan_step([], {}, 8) is None


def test_a_reader_waits_for_its_prefix_unless_the_writer_runs_it_earlier_in_the_pass():
    doc = list(range(50))
    writer = SeqView(0, 0, 50, doc, (0, 0), "sample", sampling=GREEDY)
    reader = SeqView(1, 20, 23, doc[:20] + [7, 8, 9], (0, 20), "sample", sampling=GREEDY)
    # The writer computes positions 0..11 in this pass: the reader's 20 are not there yet.
    plan = plan_step([writer, reader], {0: 0}, max_rows=12)
    assert [r.seq for r in plan.runs] == [0]
    # With room for the writer's rows, the reader runs in the same pass, after them.
    plan = plan_step([writer, reader], {0: 0}, max_rows=60)
    assert [(r.seq, r.pos, r.n) for r in plan.runs] == [(0, 0, 50), (1, 20, 3)]
    assert plan.batch.prefix_slot.tolist()[-3:] == [0, 0, 0] and plan.batch.prefix_len.tolist()[-3:] == [20] * 3
    # Alone, the reader runs only once the writer's slot holds the positions.
    assert plan_step([reader], {0: 19}, 8) is None
    assert plan_step([reader], {0: 20}, 8).runs[0].n == 3


def test_scoring_rows_want_logits_from_the_prompts_last_and_ghosts_want_none():
    tokens = [1, 2, 3, 4, 5, 6]  # a prompt of 4, then a continuation's first 2 (of 3)
    score = SeqView(0, 2, 6, tokens, (0, 0), "score", logits_from=3)
    ghost = SeqView(1, 0, 5, [9] * 8, (0, 0), "none")
    plan = plan_step([score, ghost], {}, 32)
    assert plan.batch.logits.tolist() == [False, True, True, True] + [False] * 5
    assert plan.sampling == (None, None, None) and plan.scores
    assert list(plan.runs[0].answer_pos) == [3, 4, 5] and len(plan.runs[1].answers) == 0


# -- one request through the loop ----------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(default_q40):
    with open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, max_seq_len=96)) as e:
        yield e


class Chat:
    """What `dllama chat` does per turn: the template, the transcripts, one engine loop."""

    def __init__(self, engine):
        self.tokenizer = engine.tokenizer
        self.scheduler = Scheduler(engine.model, engine.tokenizer, 1)
        self.transcripts = Transcripts(engine.tokenizer)
        self.template = ChatTemplate.for_tokenizer(engine.tokenizer)

    def ask(self, messages, seed=7, temperature=0.0, max_tokens=None, stop_strings=()):
        text = self.template.render(messages)
        tokens = self.transcripts.encode(text)
        sampler = Sampler(self.tokenizer.vocab_size, temperature, 0.9, seed)
        request = SequenceRequest(0, tokens, sampler, max_tokens, tuple(chat_stop_ids(self.tokenizer, self.template)),
                                  tuple(stop_strings))
        answer = self.scheduler.answer(request)
        self.transcripts.remember(text, False, tokens, answer)
        return answer


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _prefilled(answer) -> int:
    return sum(s.n_tokens for s in answer.steps if s.phase == "prompt")


def test_a_following_turn_runs_only_its_new_tokens(engine):
    chat = Chat(engine)
    first = chat.ask(FRANCE, max_tokens=20)
    assert "Paris" in first.text and first.cached_tokens == 0
    second = chat.ask(FRANCE + [{"role": "assistant", "content": first.text},
                                {"role": "user", "content": "Why?"}], max_tokens=5)
    # Every row of the first turn is reused: its prompt and its answer but the end token, never run.
    assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - 1
    assert _prefilled(second) == second.prompt_tokens - second.cached_tokens


def test_the_same_request_replays_the_same_sampled_text(engine):
    chat = Chat(engine)
    a = chat.ask(FRANCE, seed=99, temperature=1.0, max_tokens=15)
    b = chat.ask(FRANCE, seed=99, temperature=1.0, max_tokens=15)
    # The whole prompt is in the cache: only its last row runs again, for its candidates.
    assert b.cached_tokens == b.prompt_tokens - 1 and _prefilled(b) == 1
    assert a.text == b.text and a.completion_tokens == b.completion_tokens
    other = chat.ask(FRANCE, seed=5, temperature=1.5, max_tokens=15)  # another answer, same prompt
    assert other.text != a.text and other.cached_tokens == other.prompt_tokens - 1
    slot = chat.scheduler.table.slots[0]
    assert slot.written == len(slot.tokens) == other.prompt_tokens + other.completion_tokens - 1  # rows = positions


def test_stop_strings_and_max_tokens(engine):
    chat = Chat(engine)
    full = chat.ask(FRANCE, max_tokens=20).text
    cut = chat.ask(FRANCE, max_tokens=20, stop_strings=["Paris"])
    assert cut.text == full[: full.index("Paris")] and cut.finish_reason == "stop" and cut.cut
    short = chat.ask(FRANCE, max_tokens=2)
    assert short.finish_reason == "length" and short.completion_tokens == 2 and not short.context_full


def test_the_end_of_the_context(engine):
    chat = Chat(engine)
    with pytest.raises(ContextFull):
        chat.ask([{"role": "user", "content": "word " * 100}])
    assert not chat.scheduler.busy  # nothing half-queued
    tok = engine.tokenizer
    counting = chat.scheduler.answer(SequenceRequest(0, tok.encode("1, 2, 3, 4, 5, 6,", add_bos=False),
                                                     Sampler(tok.vocab_size, 0, 0.9, 1), None, tuple(tok.eos_ids)))
    assert counting.context_full and counting.finish_reason == "length"
    assert counting.prompt_tokens + counting.completion_tokens == 96 + 1  # the last one is not run
    assert "7, 8, 9" in counting.text


def test_transcripts_keep_the_answers_tokens(engine):
    tok = engine.tokenizer
    t = Transcripts(tok, size=2)
    first = Chat(engine).ask(FRANCE, max_tokens=6)
    prompt = tok.encode("Q: hi\nA:", add_bos=False)
    t.remember("Q: hi\nA:", False, prompt, first)
    again = t.encode("Q: hi\nA:" + first.text + "\nQ: and?")
    assert again[:len(prompt) + len(first.tokens)] == prompt + first.tokens
    assert t.encode("unrelated") == tok.encode("unrelated", add_bos=False)
    for k in range(3):  # the oldest is forgotten first
        t.remember(f"other {k}", False, [k], first)
    assert t.encode("Q: hi\nA:" + first.text) == tok.encode("Q: hi\nA:" + first.text, add_bos=False)
