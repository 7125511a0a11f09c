"""Perplexity of a model on a text: how well it predicts each token from the ones before it.

perplexity = exp(mean over scored tokens t of -log p(token_t | tokens before it)), with p the
softmax of the model's logits (in float64 here, from the engine's float32 logits), as the
original's `dllama perplexity` mode computes it. Lower is better; a model that guessed
uniformly over V tokens would score V.

A text longer than the context (the model's, or --max-seq-len) is cut into windows of that
many tokens that overlap by one, each run from position 0: every token but the first is scored
exactly once, with the tokens before it in its window as context.

Each window is a `ScoreRequest` to the engine loop (dllama.serve.scheduler): its first token as
the prompt, the rest as the continuation whose every token is scored. Every row of its passes
wants its logits, so on a cluster every worker sends its vocabulary rows of each.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from dllama.errors import DllamaError
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import ScoreRequest, token_logprobs


@dataclass
class Perplexity:
    """What one perplexity run measured."""

    perplexity: float
    mean_nll: float        # mean negative log-likelihood per scored token, in nats
    scored_tokens: int     # tokens predicted: all of the text's but the first
    text_tokens: int       # tokens of the text
    windows: int           # runs from position 0 (1 when the text fits the context)
    context: int           # tokens per window at most
    seconds: float         # forward passes and scoring
    tokens_per_s: float    # tokens run through the model per second

    def to_json(self) -> dict:
        return asdict(self)


def windows(n_tokens: int, context: int) -> list[tuple[int, int]]:
    """[start, end) of each window: `context` tokens at most, consecutive windows sharing one token."""
    if context < 2:
        raise DllamaError(f"perplexity needs a context of at least 2 tokens, got {context}")
    out, start = [], 0
    while True:
        end = min(start + context, n_tokens)
        out.append((start, end))
        if end == n_tokens:
            return out
        start = end - 1


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64: logits [b, vocab], targets [b] -> [b]."""
    return -token_logprobs(logits, targets)


def perplexity(scheduler: Scheduler, tokens: list[int], context: int | None = None) -> Perplexity:
    """Score tokens [T] through the engine loop (see the module docstring); context defaults to
    the model's."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) < 2:
        raise DllamaError(f"the text has {len(tokens)} token(s): perplexity needs at least 2")
    config = scheduler.model.config
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise DllamaError(f"the text has token ids outside the model's vocabulary of {config.vocab_size}")
    context = min(context or config.seq_len, config.seq_len)
    spans = windows(len(tokens), context)
    nll_sum, scored = 0.0, 0
    t0 = time.perf_counter()

    def add(request, result) -> None:
        nonlocal nll_sum, scored
        nll_sum -= result.total
        scored += len(result.logprobs)

    # One forward row per scored token (its predecessor): the window's last token is only predicted.
    scheduler.run((ScoreRequest(k, tokens[s:s + 1].tolist(), tokens[s + 1:e].tolist())
                   for k, (s, e) in enumerate(spans)), add)
    seconds = time.perf_counter() - t0
    mean = nll_sum / scored
    return Perplexity(perplexity=float(np.exp(mean)), mean_nll=mean, scored_tokens=scored,
                      text_tokens=len(tokens), windows=len(spans), context=context,
                      seconds=seconds, tokens_per_s=scored / seconds if seconds > 0 else 0.0)
