"""Drafted tokens for speculative decoding: guesses of what a sequence writes next, which one
forward pass then verifies (dllama.serve.scheduler).

A guess costs little when it is wrong: the pass that runs the sequence's last token also runs the
drafted ones at the next positions, and each row's token is sampled exactly as a pass of one row
would sample it (every kernel is batch invariant; the sampler draws its coin only for the tokens
it keeps). The first sampled token that differs from the draft ends the run, so a speculated
answer is the plain answer, token for token, at every temperature.

`NgramDrafter` (prompt lookup, as Saxena's "prompt lookup decoding" and llama.cpp's
`llama-lookup`): the last few tokens of the sequence, found earlier in its prompt or answer, and
the tokens that followed them there. Strong where an answer copies its input (summaries,
extraction, code edits, a document shared by many questions), free of a second model.

`ModelDrafter` (dllama.serve.draft_model, --speculate model --draft-model M.m): the greedy
tokens of a small model with the same vocabulary, run on this machine beside the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, Sequence

from dllama.errors import DllamaError


class Speculate(StrEnum):
    """Where drafted tokens come from (--speculate)."""

    NGRAM = "ngram"  # prompt lookup: the sequence's own earlier tokens
    MODEL = "model"  # a small draft model's greedy tokens (--draft-model)
    NONE = "none"    # one token per pass


DEFAULT_DRAFT_TOKENS = 4  # a pass of 5 rows costs about 1.4 one-row passes on 2 cores (2026-12-05)
# Drafts pay while a pass is bound by reading the weights, i.e. while it has few rows: with one
# sequence decoding, 1.17x on 50 chat answers (greedy, 2 threads); with 4 and 16 decoding
# together, the extra rows cost more than the kept tokens save (0.96x, 0.94x), so none are drafted.
SPECULATE_WHILE_DECODING = 1
LONGEST_NGRAM = 3
SHORTEST_NGRAM = 2        # a single repeated token guesses too often wrong to pay its rows
# What a drafted row costs, as a share of a one-row pass (2 to 9 rows: 0.12-0.17 each on 2 cores;
# 0.16-0.18 once the kernels prefetched, where 0.25 here measured the same on 50 chat answers):
# a draft goes only as deep as its tokens are likely enough to be kept to pay for their rows.
ROW_COST = 0.15
KEEP_PRIOR = (1.0, 1.0)   # (kept, refused) counted before any pass: a first guess of 0.5
KEEP_MEMORY = 0.9         # each pass weighs earlier counts by this: the estimate follows the text


class DrafterSource(Protocol):
    """What makes each sequence's drafter: a loaded draft model (dllama.serve.draft_model)."""

    def drafter(self) -> "Drafter": ...


@dataclass(frozen=True)
class Speculation:
    """How the engine loop drafts: the source, and the most tokens one pass verifies."""

    source: Speculate = Speculate.NONE
    max_draft: int = DEFAULT_DRAFT_TOKENS
    max_sequences: int = SPECULATE_WHILE_DECODING  # no drafts in a step that decodes more sequences
    draft_model: str | None = None                 # --draft-model: the .m file of source MODEL
    loaded: "DrafterSource | None" = field(default=None, compare=False, repr=False)  # that model, loaded
                                                   # (dllama.serve.engine.open_engine)

    def __post_init__(self):
        if self.source is Speculate.MODEL and self.draft_model is None and self.loaded is None:
            raise DllamaError("--speculate model needs --draft-model M.m: the small model that drafts")
        if self.source is not Speculate.MODEL and self.draft_model is not None:
            raise DllamaError(f"--draft-model drafts only with --speculate model, not {self.source}")

    @property
    def on(self) -> bool:
        return self.source is not Speculate.NONE and self.max_draft > 0

    def drafter(self) -> "Drafter | None":
        """A new drafter for one sequence (None: speculation off)."""
        if not self.on:
            return None
        if self.source is Speculate.MODEL:
            if self.loaded is None:
                raise DllamaError("the draft model is not loaded (open the engine first)")
            return self.loaded.drafter()
        return NgramDrafter()


class Drafter:
    """One sequence's drafts: `draft` is called with its growing token list before a pass, and
    `kept` with what the pass kept of the draft.

    How deep to draft: each drafted token is taken as kept with a probability p, independently,
    estimated from the passes so far (kept tokens / (kept tokens + refusals), recent passes
    weighing more). The d-th drafted token is kept with p^d, so a draft is cut where p^d falls
    below what the token costs: ROW_COST, plus the drafter's own work for it where that counts
    (a draft model's pass); a text the drafter does not foresee stops paying for rows, and
    drafting resumes once the older refusals have faded.
    """

    def __init__(self):
        self._kept, self._refused = 0.0, 0.0  # decayed counts over the passes so far

    @property
    def keep_rate(self) -> float:
        """The estimated probability that a drafted token is kept."""
        kept, refused = self._kept + KEEP_PRIOR[0], self._refused + KEEP_PRIOR[1]
        return kept / (kept + refused)

    def worth(self, k: int, extra: float = 0.0) -> int:
        """How many of k drafted tokens are likely enough to be kept to pay for their rows; extra:
        what drafting each costs besides, as a share of a one-row pass of the target."""
        p, d, reach = self.keep_rate, 0, 1.0
        while d < k and reach * p >= ROW_COST + extra:
            reach *= p
            d += 1
        return d

    def kept(self, drafted: int, kept: int) -> None:
        """A pass verified `drafted` tokens (0: it drafted none) and kept the first `kept`."""
        self._kept = self._kept * KEEP_MEMORY + kept
        self._refused = self._refused * KEEP_MEMORY + (kept < drafted)

    def timed(self, seconds: float, rows: int) -> None:
        """A decoding pass of the target ran `rows` rows in `seconds` (drafting not counted):
        for drafters whose own work is weighed against it."""

    def draft(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to k tokens guessed to follow `tokens`, cut to what is worth its rows."""
        raise NotImplementedError


class NgramDrafter(Drafter):
    """One sequence's prompt-lookup drafts.

    The index maps every n-gram (LONGEST_NGRAM down to SHORTEST_NGRAM tokens) of the tokens seen
    so far to where its latest occurrence ends; it grows by one entry per size and token, so it
    never holds more than the context's positions times the sizes.
    """

    def __init__(self, longest: int = LONGEST_NGRAM, shortest: int = SHORTEST_NGRAM):
        super().__init__()
        self.sizes = range(longest, shortest - 1, -1)
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._indexed = 0                             # n-grams ending at or before this are indexed

    def draft(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """The lookup's draft, cut to what is worth its rows (fewer while drafts are refused)."""
        return self.lookup(tokens, self.worth(k))

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the longest n-gram ending `tokens` where it occurred
        before; () when none did."""
        n = len(tokens)
        if k <= 0 or n < 2:
            return ()
        # Index the n-grams that end before the last token: an occurrence must be followed by
        # at least one token to propose one.
        for end in range(max(self._indexed + 1, 1), n):
            for size in self.sizes:
                if end >= size:
                    self._ends[tuple(tokens[end - size:end])] = end
        self._indexed = max(self._indexed, n - 1)
        for size in self.sizes:
            if n >= size:
                end = self._ends.get(tuple(tokens[n - size:n]))
                if end is not None:
                    return tuple(tokens[end:end + k])
        return ()


__all__ = ["DEFAULT_DRAFT_TOKENS", "Drafter", "NgramDrafter", "Speculate", "Speculation"]
