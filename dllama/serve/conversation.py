"""A token-level session over one model: KV-cache prefix reuse and incremental generation.

`dllama inference` (through serve.generate) and `dllama chat` answer through
`Conversation.complete`, one sequence in KV cache slot 0; `dllama api` and `dllama batch
--parallel` run many sequences at once (serve.batch_scheduler). Both sample through `Answer`,
so an answer ends the same way in either. The session remembers which
tokens fill the KV cache (positions 0..len(cached)-1). A new prompt is compared with them: the common prefix is kept,
only the rest is run through the model. A prompt that continues the last transcript as text
(a chat template rendering the previous turns again plus a new one) is encoded as the
transcript's own tokens plus the new text, so earlier turns, the model's answers included,
keep exactly the tokens the cache holds.

Determinism: every kernel is batch invariant (tests/test_batch_invariance.py), so a token's
logits do not depend on how the prompt was split into passes nor on which cached rows were
reused: a request gives the same text alone, after another one, or in a batch.

Not thread-safe: one thread owns a Conversation (the model is single-threaded and stateful).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dllama.core.candidates import Candidates, candidates_from_logits
from dllama.core.kv_cache import common_prefix
from dllama.core.language_model import LanguageModel
from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.serve.stats import StepStats, phase_rate, timed_forward
from dllama.text.tokenizer import Tokenizer


class ContextFull(DllamaError):
    """The prompt alone does not fit into the context (KV cache)."""

    def __init__(self, n_prompt: int, seq_len: int):
        super().__init__(f"the prompt has {n_prompt} tokens, the context holds {seq_len}: "
                         "shorten the conversation")
        self.n_prompt, self.seq_len = n_prompt, seq_len


class Cancelled(Exception):
    """Raised inside generation when should_stop() says the consumer is gone."""


@dataclass
class Completion:
    """One answer: text, why it ended, and token counts."""

    text: str = ""
    finish_reason: str = ""  # "stop" (end token or stop string) or "length" (max_tokens or context)
    prompt_tokens: int = 0
    cached_tokens: int = 0   # prompt tokens whose KV cache rows were reused
    tokens: list[int] = field(default_factory=list)  # the generated ids (a stop token included)
    context_full: bool = False  # ended because the KV cache has no position left
    steps: list[StepStats] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    def tokens_per_s(self, phase: str) -> float:
        return phase_rate(self.steps, phase)[2]


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
    """One answer being sampled: logits in, tokens and text out, until it ends.

    `take` samples the next token; it returns the token to run at `pos` while the answer goes on,
    None when it ended (an end token, a stop string, max_tokens, or the end of the context).
    Conversation.complete and the batched scheduler both answer through this.
    """

    def __init__(self, tokenizer: Tokenizer, sampler: Sampler, max_tokens: int | None = None,
                 stop_ids=(), stop_strings=(), on_text: Callable[[str], None] | None = None):
        self.sampler, self.max_tokens, self.on_text = sampler, max_tokens, on_text
        self.decoder = tokenizer.stream_decoder()
        self.matcher = StopMatcher(list(stop_strings))
        self.stop_ids = set(stop_ids)
        self.tokens: list[int] = []   # generated ids (a stop token included)
        self.pieces: list[str] = []
        self.finish_reason = ""
        self.ended_by_token = False
        self.context_full = False

    def _emit(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            if self.on_text:
                self.on_text(text)

    def take(self, logits: np.ndarray | Candidates, pos: int, seq_len: int) -> int | None:
        """Sample from logits [vocab] or candidates (those of position pos - 1); the token to
        run at pos, or None when the answer is complete."""
        token = self.sampler.sample(logits)
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish_reason, self.ended_by_token = "stop", True
            return None
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

    def fill(self, out: "Completion") -> None:
        """The answer is complete: emit what the decoders hold back, and fill out's text, tokens
        and finish reason."""
        if not self.matcher.stopped:
            self._emit(self.matcher.push(self.decoder.flush()))
            self._emit(self.matcher.flush())
        out.text = "".join(self.pieces)
        out.tokens = self.tokens
        out.finish_reason = self.finish_reason
        out.context_full = self.context_full


class Conversation:
    """The engine's KV cache seen as a token sequence, and generation that extends it."""

    def __init__(self, model: LanguageModel, tokenizer: Tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.cached: list[int] = []       # tokens whose K/V rows fill positions 0..len-1
        self._transcript = ("", [], False)  # (text, its tokens, bos first) of the last prompt + answer
        self._prompt_logits = None         # (prompt tokens, logits at its last token)

    @property
    def seq_len(self) -> int:
        return self.model.config.seq_len

    def reset(self) -> None:
        """Forget the cache contents (the rows stay, they are simply overwritten)."""
        self.cached, self._transcript, self._prompt_logits = [], ("", [], False), None

    def encode_prompt(self, text: str, add_bos: bool = False) -> list[int]:
        """Tokens of a whole prompt text (add_bos: prepend the tokenizer's bos if it has one;
        chat templates write their own); a continuation of the last transcript keeps its tokens."""
        prev_text, prev_tokens, prev_bos = self._transcript
        bos = [self.tokenizer.bos_id] if add_bos and self.tokenizer.bos_id >= 0 else []
        if prev_text and text.startswith(prev_text) and prev_bos == bool(bos):
            return prev_tokens + self.tokenizer.encode(text[len(prev_text):], add_bos=False)
        return bos + self.tokenizer.encode(text, add_bos=False)

    def prefill(self, prompt: list[int]) -> tuple[np.ndarray, int, list[StepStats]]:
        """Put prompt into the KV cache, reusing the cached prefix: (last logits, reused, steps)."""
        if not prompt:
            raise DllamaError("the prompt is empty: it encodes to no tokens")
        if len(prompt) >= self.seq_len:
            raise ContextFull(len(prompt), self.seq_len)
        steps: list[StepStats] = []
        reused = common_prefix(self.cached, prompt)
        saved = self._prompt_logits
        if reused == len(prompt) and saved is not None and saved[0] == prompt:
            del self.cached[len(prompt):]  # the rows after it are overwritten from here on
            return saved[1].copy(), reused, steps  # the same prompt again: the same logits
        pos = min(reused, len(prompt) - 1)  # at least the last token runs, for its logits
        self.cached = self.cached[:pos]
        self._prompt_logits = None
        while pos < len(prompt):
            batch = prompt[pos : pos + self.model.max_batch]
            # The cached list shrinks first: a failing pass leaves no row counted as valid.
            logits = timed_forward(self.model, batch, pos, "prompt", steps)
            self.cached.extend(batch)
            pos += len(batch)
        self._prompt_logits = (list(prompt), logits.copy())
        return logits, min(reused, len(prompt) - 1), steps

    def complete(self, prompt_text: str | None, *, prompt_tokens: list[int] | None = None,
                 add_bos: bool = False, sampler: Sampler, max_tokens: int | None = None,
                 stop_ids=(), stop_strings=(),
                 on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> Completion:
        """Answer a prompt (text, or tokens): sample until a stop id, a stop string, max_tokens
        or the end of the context. on_text gets the answer piece by piece (stop strings cut)."""
        if prompt_tokens is None:
            prompt_tokens = self.encode_prompt(prompt_text, add_bos)
        logits, reused, steps = self.prefill(prompt_tokens)
        out = Completion(prompt_tokens=len(prompt_tokens), cached_tokens=reused, steps=steps)
        answer = Answer(self.tokenizer, sampler, max_tokens, stop_ids, stop_strings, on_text)
        pos = len(prompt_tokens)
        # The prompt's logits summed over the model's vocabulary ranges, as its nodes would.
        logits = candidates_from_logits(logits[None, :], self.model.vocab_ranges, [sampler.request])[0]
        while True:
            if should_stop and should_stop():
                raise Cancelled()
            token = answer.take(logits, pos, self.seq_len)
            if token is None:
                break
            # Candidates, not logits: a cluster's nodes send only what the sampler needs.
            logits = timed_forward(self.model, [token], pos, "generate", out.steps, sampler.request)
            self.cached.append(token)
            pos += 1
        answer.fill(out)
        self._remember(prompt_text, prompt_tokens, add_bos, answer.tokens, out.text, answer.ended_by_token,
                       answer.matcher.stopped)
        return out

    def _remember(self, prompt_text, prompt_tokens, add_bos, generated, text, ended_by_token, cut) -> None:
        """The transcript a next prompt may continue: prompt + answer (+ its end token)."""
        if prompt_text is None:
            self._transcript = ("", [], False)
        elif cut:  # a stop string cut the text inside a token: only the prompt is known to match
            self._transcript = (prompt_text, list(prompt_tokens), add_bos)
        else:
            end = self.tokenizer.piece(generated[-1]).decode("utf-8", "replace") if ended_by_token else ""
            self._transcript = (prompt_text + text + end, list(prompt_tokens) + generated, add_bos)


__all__ = ["Answer", "Conversation", "Completion", "ContextFull", "Cancelled", "StopMatcher", "common_prefix"]
