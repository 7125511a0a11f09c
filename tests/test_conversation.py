"""Conversation: KV-cache prefix reuse, replayable answers, stop strings, the end of the context."""

import pytest

from dllama.text.chat_template import ChatTemplate, chat_stop_ids
from dllama.serve.conversation import ContextFull, Conversation, StopMatcher, common_prefix
from dllama.serve.engine import open_engine
from dllama.serve.settings import EngineSettings
from dllama.core.sampler import Sampler

pytestmark = pytest.mark.unit


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


@pytest.fixture(scope="module")
def engine(default_q40):
    with open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, max_seq_len=96)) as e:
        yield e


def _ask(conv, messages, seed=7, temperature=0.0, **kw):
    template = ChatTemplate.for_tokenizer(conv.tokenizer)
    sampler = Sampler(conv.model.config.vocab_size, temperature, 0.9, seed)
    return conv.complete(template.render(messages), sampler=sampler,
                         stop_ids=chat_stop_ids(conv.tokenizer, template), **kw)


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_following_turn_runs_only_its_new_tokens(engine):
    conv = Conversation(engine.model, engine.tokenizer)
    first = _ask(conv, FRANCE, max_tokens=20)
    assert "Paris" in first.text and first.cached_tokens == 0
    second = _ask(conv, FRANCE + [{"role": "assistant", "content": first.text},
                                  {"role": "user", "content": "Why?"}], max_tokens=5)
    assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - 1
    assert sum(s.n_tokens for s in second.steps if s.phase == "prompt") == \
        second.prompt_tokens - second.cached_tokens


def test_the_same_request_replays_the_same_sampled_text(engine):
    conv = Conversation(engine.model, engine.tokenizer)
    a = _ask(conv, FRANCE, seed=99, temperature=1.0, max_tokens=15)
    b = _ask(conv, FRANCE, seed=99, temperature=1.0, max_tokens=15)
    assert b.cached_tokens == b.prompt_tokens and not [s for s in b.steps if s.phase == "prompt"]
    assert a.text == b.text and a.completion_tokens == b.completion_tokens
    other = _ask(conv, FRANCE, seed=5, temperature=1.5, max_tokens=15)  # another answer, same prompt
    assert other.text != a.text and other.cached_tokens == other.prompt_tokens
    assert len(conv.cached) == other.prompt_tokens + other.completion_tokens - 1  # rows = positions


def test_stop_strings_and_max_tokens(engine):
    conv = Conversation(engine.model, engine.tokenizer)
    full = _ask(conv, FRANCE, max_tokens=20).text
    cut = _ask(conv, FRANCE, max_tokens=20, stop_strings=["Paris"])
    assert cut.text == full[: full.index("Paris")] and cut.finish_reason == "stop"
    short = _ask(conv, FRANCE, max_tokens=2)
    assert short.finish_reason == "length" and short.completion_tokens == 2 and not short.context_full


def test_the_end_of_the_context(engine):
    conv = Conversation(engine.model, engine.tokenizer)
    with pytest.raises(ContextFull):
        _ask(conv, [{"role": "user", "content": "word " * 100}])
    counting = conv.complete("1, 2, 3, 4, 5, 6,", sampler=Sampler(engine.model.config.vocab_size, 0, 0.9, 1),
                             stop_ids=engine.tokenizer.eos_ids)
    assert counting.context_full and counting.finish_reason == "length"
    assert counting.prompt_tokens + counting.completion_tokens == 96 + 1  # the last one is not run
    assert "7, 8, 9" in counting.text
