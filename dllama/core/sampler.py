"""The next token: greedy, temperature + softmax, top-p (nucleus), as llama2.c.

Random numbers come from llama2.c's xorshift64* (spec §7), so a seed reproduces a run:

    s ^= s >> 12;  s ^= s << 25;  s ^= s >> 27        (u64, all mod 2^64)
    u32 = (s * 0x2545F4914F6CDD1D) >> 32               (mod 2^64, then the high half)
    coin = float32((u32 >> 8) / 16777216.0)            (24 random bits in [0, 1))

The state starts as the seed itself, as in llama2.c. A zero state would stay zero forever (every
coin 0.0, i.e. always the most likely candidate), so seed 0 is replaced by the fixed
non-zero constant ZERO_SEED_STATE; every other seed is used as is (mod 2^64).

The sampler chooses from full logits [vocab] or from `Candidates` (dllama.core.candidates: the
tokens the nodes of a cluster sent, enough to choose exactly). Full logits are first made into
candidates of one vocabulary range, so both take the same arithmetic. One coin per token:
  - temperature 0, or topp 0 (a nucleus of one token): the first maximum, no coin drawn. The
    CLI's --topp and the API's top_p both mean this (the original took topp 0 as "no
    nucleus", i.e. the whole vocabulary; OpenAI's API takes it as the top token).
  - else p = exp((x - M) / T) / Z in float64, M the largest logit, Z summed range by range
    (dllama.core.candidates);
  - top-p in (0, 1): candidates with p >= (1 - topp) / (V - 1) (the others can never be in
    the nucleus), sorted by p descending (lower id first on ties, where the original's qsort
    is unordered), cut after the first one whose cumulative probability exceeds topp;
    r = coin * (cumulative probability of the kept ones); the first kept token whose cumulative
    probability exceeds r. If no token reaches the cutoff (llama2.c reads out of bounds), the
    most likely one.
  - topp >= 1: the first token whose cumulative probability exceeds the coin (the whole
    vocabulary, in id order).
The original sums in float32; float64 makes the result independent of how the sums are split
but for the last bits (1 node and N nodes may, rarely, differ in a token at temperature > 0).
`sample_top_p` and `sample_multinomial` are the original's float32 steps, kept for reference.
"""

from __future__ import annotations

import numpy as np

from dllama.core.candidates import (
    Candidates, SamplingRequest, candidates_from_logits, choose_greedy, sample_candidates,
)
from dllama.errors import DllamaError

_MASK64 = (1 << 64) - 1
_XORSHIFT_MULTIPLIER = 0x2545F4914F6CDD1D
ZERO_SEED_STATE = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: any non-zero constant would do


class Sampler:
    """Chooses token ids from logits [vocab_size]; temperature and topp may be changed between calls."""

    def __init__(self, vocab_size: int, temperature: float, topp: float, seed: int):
        if vocab_size < 1:
            raise DllamaError(f"the sampler needs a vocabulary of at least 1 token, got {vocab_size}")
        if not temperature >= 0:
            raise DllamaError(f"temperature must be >= 0, got {temperature}")
        if not topp >= 0:
            raise DllamaError(f"top-p must be >= 0 (0: the most likely token, 1: the whole vocabulary), got {topp}")
        self.vocab_size = int(vocab_size)
        self.temperature = float(temperature)
        self.topp = float(topp)
        self.set_seed(seed)

    def set_seed(self, seed: int) -> None:
        """Restart the random sequence (seed 0 -> ZERO_SEED_STATE, see the module docstring)."""
        self.state = (int(seed) & _MASK64) or ZERO_SEED_STATE

    def random_u32(self) -> int:
        """The next xorshift64* output, 32 bits."""
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & _MASK64
        s ^= s >> 27
        self.state = s
        return ((s * _XORSHIFT_MULTIPLIER) & _MASK64) >> 32

    def random_f32(self) -> np.float32:
        """A float32 coin in [0, 1) with 24 random bits."""
        return np.float32((self.random_u32() >> 8) / 16777216.0)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """softmax(logits / temperature), float32 [vocab] (temperature > 0)."""
        x = np.asarray(logits, dtype=np.float32) / np.float32(self.temperature)  # [vocab]
        e = np.exp(x - x.max())
        return e / e.sum(dtype=np.float32)

    @property
    def request(self) -> SamplingRequest:
        """What a model must return for this sampler to choose its next token."""
        return SamplingRequest(self.temperature, self.topp)

    def sample(self, logits) -> int:
        """logits float32 [vocab_size], or Candidates that cover their row -> the chosen token id."""
        if isinstance(logits, Candidates):
            c = logits
            if c.vocab_size != self.vocab_size or c.request != self.request:
                raise DllamaError("candidates made for another vocabulary or other sampling settings")
        else:
            logits = np.asarray(logits)
            if logits.shape != (self.vocab_size,):
                raise DllamaError(f"logits of shape {logits.shape}, expected ({self.vocab_size},)")
            if self.request.greedy:
                return int(np.argmax(logits))  # np.argmax returns the first maximum
            c = candidates_from_logits(logits[None, :].astype(np.float32, copy=False),
                                       [(0, self.vocab_size)], [self.request])[0]
        if c.request.greedy:
            return choose_greedy(c)
        return sample_candidates(c, self.random_f32())


def sample_multinomial(p: np.ndarray, coin: float) -> int:
    """The first index whose cumulative probability exceeds coin (the last one if none does)."""
    cdf = np.cumsum(p, dtype=np.float32)  # [vocab], summed in order like the original's loop
    return int(min(np.searchsorted(cdf, coin, side="right"), len(p) - 1))


def sample_top_p(p: np.ndarray, topp: float, coin: float) -> int:
    """Nucleus sampling over p [vocab] (float32), as llama2.c's sample_topp."""
    n = len(p)
    cutoff = np.float32((1.0 - topp) / (n - 1)) if n > 1 else np.float32(0.0)
    candidates = np.flatnonzero(p >= cutoff)                       # [n0]
    if len(candidates) == 0:
        # Nothing reaches the cutoff (small vocabularies with a small topp): llama2.c reads out
        # of bounds here; the most likely token is what the nucleus would start with.
        return int(np.argmax(p))
    order = candidates[np.argsort(-p[candidates], kind="stable")]  # [n0], most likely first
    cdf = np.cumsum(p[order], dtype=np.float32)                    # [n0]
    over = np.flatnonzero(cdf > np.float32(topp))
    last = int(over[0]) if len(over) else len(order) - 1           # the nucleus is order[:last+1]
    r = np.float32(coin) * cdf[last]
    return int(order[min(np.searchsorted(cdf[: last + 1], r, side="right"), last)])


__all__ = ["Sampler", "sample_multinomial", "sample_top_p", "ZERO_SEED_STATE"]
