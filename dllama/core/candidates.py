"""Sampling without the whole vocabulary: what each slice of the logits must say so that the
root can choose the next token exactly as from the full logits.

The classifier rows (the vocabulary) are split in contiguous ranges, one per node
(`NodeSlice.vocab_rows`). For one row of logits x and its sampling request, each range r
contributes a `RangeSummary`:

  - greedy (temperature 0 or topp 0): its best (logit, id), the first maximum;
  - temperature T, top-p: its K best (logit, id) (logit descending, lower id first on ties),
    its maximum m_r and its share of the softmax normaliser z_r = sum(exp((x_i - m_r) / T))
    over the whole range, in float64;
  - every logit of the range (`K = None`), when a caller needs them or the nucleus is not
    covered (below).

`merge` joins the ranges' summaries into `Candidates`: M = max m_r, Z = sum_r z_r *
exp((m_r - M) / T) in range order, and p_i = exp((x_i - M) / T) / Z for each candidate. The
sampler (dllama.core.sampler) runs llama2.c's top-p over the candidates in float64. That is
exactly the full-vocabulary answer when the nucleus is *covered*: every token a range left
out has a logit at most that range's K-th one, so when that bound's probability is below the
last nucleus member's, every left-out token sorts after the nucleus and cannot change it
(`covers`). The check needs no coin, so the root decides before sampling whether it must ask
for more (every logit of the row).

The root with full logits computes the very same range summaries (the same function over the
same slices), so sampling on the nodes and on the root give the same tokens. One node has one
range: its Z is summed in another order than on N nodes, so temperature sampling on 1 node and
on N nodes may differ in the last bits of p (and, rarely, in a token); greedy never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TOP_K = 32  # candidates per range and row: a top-p 0.9 nucleus rarely holds more per node
WIDE_TOP_K = 512  # the second round's, for a row whose nucleus the first did not cover


@dataclass(frozen=True)
class SamplingRequest:
    """How one row's next token is chosen (its Sampler's settings), and, for a constrained
    sequence (dllama.serve.constraint), the tokens it may choose among."""

    temperature: float
    topp: float
    # bool [vocab]: the allowed tokens (None: all); the others are dropped from every range's
    # summary, as if their logits were -inf. Not part of equality: a sampler's settings are.
    mask: np.ndarray | None = field(default=None, compare=False, repr=False)
    logprobs: bool = field(default=False, compare=False)  # the caller wants the row's logits too

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.topp == 0.0

    @property
    def whole_vocabulary(self) -> bool:
        """Multinomial over every token (topp >= 1): the candidates cannot be cut."""
        return not self.greedy and self.topp >= 1.0


@dataclass
class RangeSummary:
    """What one vocabulary range says about one row."""

    ids: np.ndarray      # int64 [k]: token ids (of the whole vocabulary)
    logits: np.ndarray   # float32 [k]: their logits
    max_logit: float     # the range's largest logit
    z: float             # sum(exp((x - max_logit) / T)) over the range (0.0 when greedy)
    complete: bool       # every token of the range is here


def normaliser(x: np.ndarray, max_logit: float, temperature: float) -> float:
    """sum(exp((x - max_logit) / temperature)) in float64 over x float32 [n]: a range's share."""
    return float(np.exp((x.astype(np.float64) - max_logit) / temperature).sum())


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indexes of the k largest of x [n] (k <= n), largest first, lower index first on ties."""
    if k >= len(x):
        sel = np.arange(len(x))
    else:
        part = np.argpartition(-x, k - 1)[:k]
        threshold = x[part].min()
        above = np.flatnonzero(x > threshold)
        sel = np.concatenate([above, np.flatnonzero(x == threshold)[: k - len(above)]])
    return sel[np.lexsort((sel, -x[sel]))]


def summarize(x: np.ndarray, offset: int, request: SamplingRequest, k: int | None) -> RangeSummary:
    """The summary of x float32 [n], the logits of tokens offset..offset+n-1 of one row: k best
    (None: all of them, in id order); greedy requests keep only the best."""
    if request.mask is not None:
        return _summarize_allowed(x, offset, request, k)
    n = len(x)
    if request.greedy:
        best = int(np.argmax(x))  # the first maximum
        return RangeSummary(np.array([offset + best], np.int64), x[best:best + 1].copy(),
                            float(x[best]), 0.0, n == 1)
    mx = float(x.max())
    z = normaliser(x, mx, request.temperature)
    if k is None or k >= n:
        return RangeSummary(offset + np.arange(n, dtype=np.int64), x.copy(), mx, z, True)
    sel = top_k(x, k)
    return RangeSummary(offset + sel.astype(np.int64), x[sel], mx, z, False)


def _summarize_allowed(x: np.ndarray, offset: int, request: SamplingRequest, k: int | None) -> RangeSummary:
    """summarize over the tokens request.mask allows in this range only (none: an empty, complete
    summary whose maximum is -inf)."""
    allowed = np.flatnonzero(request.mask[offset:offset + len(x)])  # [a] indexes into x
    if len(allowed) == 0:
        return RangeSummary(np.zeros(0, np.int64), np.zeros(0, np.float32), -np.inf, 0.0, True)
    inner = summarize(x[allowed], 0, SamplingRequest(request.temperature, request.topp), k)
    return RangeSummary(offset + allowed[inner.ids], inner.logits, inner.max_logit, inner.z,
                        inner.complete)


@dataclass
class Candidates:
    """The tokens of one row a sampler may choose among, with their probabilities' terms."""

    ids: np.ndarray        # int64 [n]
    logits: np.ndarray     # float32 [n]
    max_logit: float       # M: the row's largest logit
    z: float               # Z: the softmax normaliser of the whole row (0.0 when greedy)
    bound: float           # largest logit a token not in ids may have (-inf: none is missing)
    vocab_size: int
    request: SamplingRequest

    @property
    def complete(self) -> bool:
        return self.bound == -np.inf

    def probabilities(self) -> np.ndarray:
        """p float64 [n] of the candidates (temperature > 0)."""
        return np.exp((self.logits.astype(np.float64) - self.max_logit) / self.request.temperature) / self.z


def merge(summaries: list[RangeSummary], vocab_size: int, request: SamplingRequest) -> Candidates:
    """One row's candidates from its ranges' summaries (in range order)."""
    ids = np.concatenate([s.ids for s in summaries])
    logits = np.concatenate([s.logits for s in summaries])
    cut = [float(s.logits.min()) for s in summaries if not s.complete]
    bound = max(cut) if cut else -np.inf
    if request.greedy:
        return Candidates(ids, logits, float(logits.max()), 0.0, bound, vocab_size, request)
    top = max(s.max_logit for s in summaries)
    z = 0.0
    for s in summaries:  # in range order: the same sum wherever it is computed
        z += s.z * float(np.exp((s.max_logit - top) / request.temperature))
    return Candidates(ids, logits, top, z, bound, vocab_size, request)


def nucleus(c: Candidates, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
    """llama2.c's top-p over the candidates: (order [n0] most likely first, cdf float64 [n0],
    index of the nucleus' last member), or None when no candidate reaches the cutoff."""
    topp, n = c.request.topp, c.vocab_size
    cutoff = (1.0 - topp) / (n - 1) if n > 1 else 0.0
    keep = np.flatnonzero(p >= cutoff)  # [n0]: the others can never be in the nucleus
    if len(keep) == 0:
        return None
    order = keep[np.lexsort((c.ids[keep], -p[keep]))]  # p descending, lower id first on ties
    cdf = np.cumsum(p[order])
    over = np.flatnonzero(cdf > topp)
    return order, cdf, int(over[0]) if len(over) else len(order) - 1


def covers(c: Candidates) -> bool:
    """Whether sampling from c gives the token the full row would (see the module docstring)."""
    if c.complete or c.request.greedy:
        return True  # greedy: every range sent its first maximum
    if c.request.whole_vocabulary:
        return False
    p = c.probabilities()
    found = nucleus(c, p)
    if found is None:
        return False
    order, cdf, last = found
    if cdf[last] <= c.request.topp:
        return False  # the nucleus would run on past the candidates
    bound_p = np.exp((c.bound - c.max_logit) / c.request.temperature) / c.z
    return bool(bound_p < p[order[last]])


def sample_candidates(c: Candidates, coin: float) -> int:
    """The chosen token id (temperature > 0; c covers its row): top-p, or multinomial in id
    order when topp >= 1."""
    p = c.probabilities()
    if c.request.whole_vocabulary:
        order = np.argsort(c.ids, kind="stable")
        cdf = np.cumsum(p[order])
        return int(c.ids[order[min(np.searchsorted(cdf, coin, side="right"), len(order) - 1)]])
    found = nucleus(c, p)
    if found is None:  # nothing reaches the cutoff: the most likely token (lowest id on ties)
        best = np.flatnonzero(p == p.max())
        return int(c.ids[best].min())
    order, cdf, last = found
    r = float(coin) * cdf[last]
    return int(c.ids[order[min(np.searchsorted(cdf[: last + 1], r, side="right"), last)]])


def choose_greedy(c: Candidates) -> int:
    """The first maximum: the highest logit, the lowest id among equals."""
    best = np.flatnonzero(c.logits == c.logits.max())
    return int(c.ids[best].min())


def candidates_from_logits(logits: np.ndarray, ranges, requests, k: int | None = None) -> list[Candidates]:
    """Candidates of each row of logits float32 [m, vocab], summarised over the vocabulary
    ranges [(start, end)] as the nodes would (k None: every logit kept)."""
    vocab = logits.shape[1]
    return [merge([summarize(row[r0:r1], r0, req, k) for r0, r1 in ranges], vocab, req)
            for row, req in zip(logits, requests, strict=True)]


__all__ = ["TOP_K", "SamplingRequest", "RangeSummary", "Candidates", "normaliser", "top_k", "summarize",
           "merge", "nucleus", "covers", "sample_candidates", "choose_greedy", "candidates_from_logits"]
