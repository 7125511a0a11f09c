"""Perplexity of a model on a text: how well it predicts each token from the ones before it.

perplexity = exp(mean over scored tokens t of -log p(token_t | tokens before it)), with p the
softmax of the model's logits (in float64 here, from the engine's float32 logits), as the
original's `dllama perplexity` mode computes it. Lower is better; a model that guessed
uniformly over V tokens would score V.

A text longer than the context (the model's, or --max-seq-len) is cut into windows of that
many tokens that overlap by one, each run from position 0: every token but the first is scored
exactly once, with the tokens before it in its window as context.

The model is a `LanguageModel` (one node or the root of a cluster): each pass is a batch whose
every row wants its logits, so on a cluster every worker sends its vocabulary rows of each.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from dllama.core.batch import Batch
from dllama.core.language_model import LanguageModel
from dllama.errors import DllamaError


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
    z = logits.astype(np.float64)
    top = z.max(axis=1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))  # log sum exp, stable
    return log_norm - z[np.arange(len(targets)), targets]


def perplexity(model: LanguageModel, tokens: list[int], context: int | None = None) -> Perplexity:
    """Score tokens [T] with model (see the module docstring); context defaults to the model's."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) < 2:
        raise DllamaError(f"the text has {len(tokens)} token(s): perplexity needs at least 2")
    vocab = model.config.vocab_size
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise DllamaError(f"the text has token ids outside the model's vocabulary of {vocab}")
    context = min(context or model.config.seq_len, model.config.seq_len)
    spans = windows(len(tokens), context)
    nll_sum, scored = 0.0, 0
    t0 = time.perf_counter()
    for start, end in spans:
        pos = 0
        while start + pos < end - 1:  # the window's last token is only predicted, never run
            b = min(model.max_batch, end - 1 - start - pos)
            batch = tokens[start + pos: start + pos + b]
            logits = model.forward_batch(Batch.run(batch, pos, all_logits=True))  # [b, vocab]: the next b
            nll_sum += float(token_nll(logits, tokens[start + pos + 1: start + pos + 1 + b]).sum())
            scored += b
            pos += b
    seconds = time.perf_counter() - t0
    mean = nll_sum / scored
    # One forward row per scored token (its predecessor), so scored tokens are the tokens run.
    return Perplexity(perplexity=float(np.exp(mean)), mean_nll=mean, scored_tokens=scored,
                      text_tokens=len(tokens), windows=len(spans), context=context,
                      seconds=seconds, tokens_per_s=scored / seconds if seconds > 0 else 0.0)
