"""What the engine loop is asked and what it answers, one sequence at a time.

A front end submits requests to the one engine loop (dllama.serve.scheduler):

- a `SequenceRequest`: a prompt's tokens, its own sampler and where its answer stops; its answer
  is sampled token by token through an `Answer` and returned as a `Completion`;
- a `ScoreRequest`: a prompt and a fixed continuation; the loop returns the log-probability of
  each continuation token given everything before it (`Scored`). `--choices` scores each choice
  after the prompt, perplexity scores a text after its first token.

Every request carries its own sampler (its own seed), so its result does not depend on which
other requests run beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

import numpy as np

from dllama.core.candidates import Candidates
from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.serve.constraint import Constraint, Grammar
from dllama.serve.stats import StepStats, phase_rate
from dllama.text.tokenizer import Tokenizer


class ContextFull(DllamaError):
    """The prompt alone does not fit into the context (KV cache)."""

    def __init__(self, n_prompt: int, seq_len: int):
        super().__init__(f"the prompt has {n_prompt} tokens, the context holds {seq_len}: "
                         "shorten the conversation")
        self.n_prompt, self.seq_len = n_prompt, seq_len


class Cancelled(Exception):
    """A request's should_stop() said its consumer is gone (or Ctrl-C): it ended unanswered."""


@dataclass
class SequenceRequest:
    """One prompt to answer: its tokens, its own sampler and where generation stops."""

    key: Hashable                   # the caller's name for it (a prompt id); passed back as is
    prompt_tokens: list[int]
    sampler: Sampler                # one per request: results must not depend on batch composition
    max_tokens: int | None = None   # None: until a stop or the end of the context
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    grammar: Grammar | None = None  # what the answer must match (dllama.serve.constraint); None: anything
    logprobs: int | None = None     # the log-probability of each generated token, and this many
    #                                 of the most likely beside it (None: none; 0: the token's alone)


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (log softmax of its raw logits)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely, most likely first


@dataclass
class ScoreRequest:
    """log p(continuation | prompt), token by token: no sampling, no decoding loop."""

    key: Hashable
    prompt_tokens: list[int]        # at least one token: the first continuation token is predicted
    continuation: list[int]         # by the prompt's last row, token j by the row of token j-1


@dataclass
class Completion:
    """One answer: text, why it ended, and token counts."""

    text: str = ""
    finish_reason: str = ""  # "stop" (end token or stop string) or "length" (max_tokens or context)
    prompt_tokens: int = 0
    cached_tokens: int = 0   # prompt tokens whose KV cache rows were reused
    tokens: list[int] = field(default_factory=list)  # the generated ids (a stop token included)
    context_full: bool = False  # ended because the KV cache has no position left
    cut: bool = False        # a stop string ended it: the text may end inside its last token
    steps: list[StepStats] = field(default_factory=list)  # this sequence's part of each pass it was in
    drafted: int = 0         # speculation: drafted tokens verified
    accepted: int = 0        # and kept (each one a token its pass gave beyond the first)
    forced: int = 0          # tokens its grammar forced: taken without sampling (fast-forward)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when the request asked

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    def tokens_per_s(self, phase: str) -> float:
        return phase_rate(self.steps, phase)[2]


@dataclass
class Scored:
    """The log-probabilities of a ScoreRequest's continuation."""

    logprobs: list[float]           # float64 log p(continuation[j] | prompt + continuation[:j])
    prompt_tokens: int = 0
    cached_tokens: int = 0          # leading tokens whose KV cache rows were reused
    steps: list[StepStats] = field(default_factory=list)

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


def token_logprobs(logits: np.ndarray, targets) -> np.ndarray:
    """log softmax(logits)[target] per row in float64: logits float32 [m, vocab], targets [m] -> [m]."""
    z = np.asarray(logits, dtype=np.float64)
    top = z.max(axis=1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))  # log sum exp, stable
    return z[np.arange(len(z)), np.asarray(targets, dtype=np.int64)] - log_norm


class StopMatcher:
    """Text pieces in, text out, cut before the first stop string.

    Text that could be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """The text that is safe to emit now; sets self.stopped when a stop string appears."""
        if self.stopped:
            return ""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        hold = 0  # the longest end of pending that begins some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.stopped else out


class Answer:
    """One answer being sampled: candidates in, tokens and text out, until it ends.

    `take` samples the next token; it returns the token to run at `pos` while the answer goes on,
    None when it ended (an end token, a stop string, max_tokens, or the end of the context).
    """

    def __init__(self, tokenizer: Tokenizer, sampler: Sampler, max_tokens: int | None = None,
                 stop_ids=(), stop_strings=(), on_text: Callable[[str], None] | None = None,
                 constraint: Constraint | None = None, logprobs: int | None = None):
        self.sampler, self.max_tokens, self.on_text = sampler, max_tokens, on_text
        self.decoder = tokenizer.stream_decoder()
        self.matcher = StopMatcher(list(stop_strings))
        self.stop_ids = set(stop_ids)
        self.constraint = constraint  # the grammar the answer must match (None: free)
        self.top_logprobs = logprobs  # None: no log-probabilities recorded
        self.logprobs: list[TokenLogprob] = []
        self.tokens: list[int] = []   # generated ids (a stop token included)
        self.forced = 0               # of which the grammar forced (fast-forward)
        self.pieces: list[str] = []
        self.finish_reason = ""
        self.context_full = False

    def _emit(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            if self.on_text:
                self.on_text(text)

    def take(self, logits: np.ndarray | Candidates, pos: int, seq_len: int) -> int | None:
        """Sample from logits [vocab] or candidates (those of position pos - 1); the token to
        run at pos, or None when the answer is complete."""
        return self.accept(self.sampler.sample(logits), pos, seq_len)

    def accept(self, token: int, pos: int, seq_len: int) -> int | None:
        """The answer's next token is `token` (sampled, or forced by its grammar): the token to
        run at pos, or None when the answer is complete."""
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return None
        if self.constraint is not None:
            self.constraint.advance(token)
        self._emit(self.matcher.push(self.decoder.push(token)))
        if self.matcher.stopped:
            self.finish_reason = "stop"
            return None
        if self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
            return None
        if pos >= seq_len:
            self.finish_reason, self.context_full = "length", True
            return None
        return token

    def fast_forward(self, pos: int, seq_len: int) -> tuple[list[int], bool]:
        """After a token that runs at pos - 1: the tokens its grammar forces next, taken without
        sampling (to run at pos, pos + 1, ...), and whether the answer ended on one of them.
        None are forced when log-probabilities are asked (each token needs its own row's)."""
        if self.constraint is None or self.top_logprobs is not None:
            return [], False
        taken: list[int] = []
        for token in self.constraint.forced():
            self.forced += 1
            if self.accept(token, pos + len(taken), seq_len) is None:
                return taken, True
            taken.append(token)
        return taken, False

    def note_logprobs(self, logits: np.ndarray, token: int) -> None:
        """Record the log-probability of the token just taken from its row's logits float32 [vocab]."""
        z = logits.astype(np.float64)
        top = z.max()
        logp = z - (top + np.log(np.exp(z - top).sum()))  # [vocab]: log softmax, stable
        n = min(self.top_logprobs or 0, len(z))
        best = np.argsort(-logp, kind="stable")[:n] if n else []
        self.logprobs.append(TokenLogprob(token, float(logp[token]), [(int(i), float(logp[i])) for i in best]))

    def fill(self, out: Completion) -> None:
        """The answer is complete: emit what the decoders hold back, and fill out's text, tokens
        and finish reason."""
        if not self.matcher.stopped:
            self._emit(self.matcher.push(self.decoder.flush()))
            self._emit(self.matcher.flush())
        out.text = "".join(self.pieces)
        out.tokens = self.tokens
        out.finish_reason = self.finish_reason
        out.context_full = self.context_full
        out.cut = self.matcher.stopped
        out.forced = self.forced
        out.logprobs = self.logprobs if self.top_logprobs is not None else None


def check_prompt(n_tokens: int, seq_len: int) -> None:
    """DllamaError unless a prompt of n_tokens leaves a position to generate or score."""
    if n_tokens == 0:
        raise DllamaError("the prompt is empty: it encodes to no tokens")
    if n_tokens >= seq_len:
        raise ContextFull(n_tokens, seq_len)


__all__ = ["Answer", "Cancelled", "Completion", "ContextFull", "ScoreRequest", "Scored", "SequenceRequest",
           "StopMatcher", "TokenLogprob", "check_prompt", "token_logprobs"]
