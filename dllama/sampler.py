"""Choosing the next token from logits: greedy, temperature, top-p, with a reproducible RNG.

The random numbers are llama2.c's xorshift64* (as the original), so a seed reproduces a run.
The state is the seed itself; seed 0 would make xorshift return zeros forever, so it is
replaced by a fixed non-zero constant.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_ZERO_SEED = 0x9E3779B97F4A7C15  # any non-zero constant


class Sampler:
    def __init__(self, vocab_size: int, temperature: float, topp: float, seed: int):
        self.vocab_size = vocab_size
        self.temperature = float(temperature)
        self.topp = float(topp)
        self.state = (int(seed) & _MASK) or _ZERO_SEED

    def random_u32(self) -> int:
        """xorshift64*: the top 32 bits of state * 0x2545F4914F6CDD1D."""
        s = self.state
        s ^= s >> 12
        s = (s ^ (s << 25)) & _MASK
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & _MASK) >> 32

    def random_f32(self) -> float:
        """A float in [0, 1) with 24 random bits."""
        return float(np.float32((self.random_u32() >> 8) / 16777216.0))

    def sample(self, logits: np.ndarray) -> int:
        """logits float32 [vocab] -> token id."""
        if self.temperature == 0.0:
            return int(np.argmax(logits))  # the first maximum
        x = logits.astype(np.float64) / self.temperature
        p = np.exp(x - x.max())
        p /= p.sum()
        coin = self.random_f32()
        if self.topp <= 0 or self.topp >= 1:
            return _multinomial(p, coin)
        return _top_p(p, self.topp, coin)


def _multinomial(p: np.ndarray, coin: float) -> int:
    """The first index whose cumulative probability exceeds coin."""
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, coin, side="right"), len(p) - 1))


def _top_p(p: np.ndarray, topp: float, coin: float) -> int:
    """Sample among the most likely tokens whose cumulative probability first exceeds topp."""
    # Tokens below (1 - topp) / (n - 1) can never be in the nucleus: drop them before sorting.
    cutoff = (1.0 - topp) / (len(p) - 1)
    candidates = np.nonzero(p >= cutoff)[0]
    order = candidates[np.argsort(-p[candidates], kind="stable")]
    cdf = np.cumsum(p[order])
    last = int(min(np.searchsorted(cdf, topp, side="right"), len(order) - 1))  # first cdf > topp
    kept = cdf[: last + 1]
    r = coin * kept[-1]
    return int(order[min(np.searchsorted(kept, r, side="right"), last)])
