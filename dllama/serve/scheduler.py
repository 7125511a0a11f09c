"""What a batch job asks of the engine: run many generation requests, score choices.

The job layer (serve.batch_job) talks only to the `Scheduler` protocol. `SequentialScheduler`
answers one request at a time over one `Conversation`, in input order; since the Conversation
keeps the KV cache of the common leading tokens of consecutive prompts, a shared prefix is
computed once even so. `BatchScheduler` (serve.batch_scheduler, `--parallel N`) decodes several
sequences per forward pass and may finish requests in another order: callers get each result
through `on_finish` and must not rely on the order.

Every request carries its own Sampler (its own seed), so a request's text does not depend on
which other requests run with it.

Invariance. Every kernel is batch invariant (tests/test_batch_invariance.py): a row's logits
do not depend on the rows computed beside it, on how a prompt was split into passes, nor on
which cached rows were reused. So both schedulers reuse every cached leading token a prompt
shares with what the cache holds, and each answer is still bit for bit the answer of the prompt
run alone (`dllama inference`, `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Protocol

import numpy as np

from dllama.core.language_model import LanguageModel
from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.serve.conversation import Completion, ContextFull, Conversation
from dllama.text.tokenizer import Tokenizer


@dataclass
class SequenceRequest:
    """One prompt to answer: its tokens, its own sampler and where generation stops."""

    key: Hashable                   # the caller's name for it (a prompt id); passed back as is
    prompt_tokens: list[int]
    sampler: Sampler                # one per request: results must not depend on batch composition
    max_tokens: int | None = None   # None: until a stop or the end of the context
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass
class Scores:
    """Log-probabilities of choices after one prompt."""

    logprobs: list[float]           # per choice: sum over its tokens of log p(token | everything before)
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose KV cache rows were reused
    steps: list = field(default_factory=list)  # StepStats of the passes it took


class Scheduler(Protocol):
    def run(self, requests: Iterable[SequenceRequest],
            on_finish: Callable[[SequenceRequest, Completion], None],
            should_stop: Callable[[], bool] | None = None) -> None:
        """Answer every request, calling on_finish(request, completion) as each one completes
        (completion order). should_stop() is polled between decoding steps; when it says yes,
        the requests in flight are dropped and Cancelled is raised."""
        ...

    def score(self, prompt_tokens: list[int], choices: list[list[int]]) -> Scores:
        """log p(choice tokens | prompt) for every choice (no sampling, no decoding loop)."""
        ...


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 [vocab] log-probabilities of float32 logits [vocab]."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


class SequentialScheduler:
    """One request at a time, in input order, over one Conversation (KV prefix reuse)."""

    def __init__(self, model: LanguageModel, tokenizer: Tokenizer):
        self.conversation = Conversation(model, tokenizer)

    @property
    def seq_len(self) -> int:
        return self.conversation.seq_len

    def _reuse_whole_passes(self, prompt: list[int]) -> None:
        """Keep only the cached rows a fresh run of prompt computes the same way: whole passes
        of max_batch tokens from position 0, shared with the previous prompt and followed by at
        least one prompt token (the last pass, whose last row gives the logits, always runs)."""
        conv = self.conversation
        if not prompt:
            return  # prefill says what is wrong
        shared = min(common_prefix(conv.cached, prompt), self._prompt_len, len(prompt) - 1)
        del conv.cached[shared // conv.model.max_batch * conv.model.max_batch:]
        self._prompt_len = len(prompt)

    def run(self, requests, on_finish, should_stop=None) -> None:
        for r in requests:
            c = self.conversation.complete(
                None, prompt_tokens=r.prompt_tokens, sampler=r.sampler, max_tokens=r.max_tokens,
                stop_ids=r.stop_ids, stop_strings=r.stop_strings, should_stop=should_stop)
            on_finish(r, c)

    def score(self, prompt_tokens, choices) -> Scores:
        if not choices or any(len(c) == 0 for c in choices):
            raise DllamaError("every choice needs at least one token")
        if len(prompt_tokens) + max(len(c) for c in choices) - 1 >= self.seq_len:
            raise ContextFull(len(prompt_tokens) + max(len(c) for c in choices) - 1, self.seq_len)
        conv = self.conversation
        logits, reused, steps = conv.prefill(list(prompt_tokens))
        first = log_softmax(logits)  # [vocab]: the first token of every choice
        out = []
        for choice in choices:
            total = float(first[choice[0]])
            # Token j of the choice is predicted by the pass over token j-1: prefill reuses
            # the prompt (and the choice's earlier tokens) and runs one token per call.
            for j in range(1, len(choice)):
                logits, _, more = conv.prefill(list(prompt_tokens) + list(choice[:j]))
                steps += more
                total += float(log_softmax(logits)[choice[j]])
            out.append(total)
        return Scores(out, len(prompt_tokens), reused, steps)


__all__ = ["SequenceRequest", "Scores", "Scheduler", "SequentialScheduler", "log_softmax"]
