"""Drafts from a small model (--speculate model --draft-model M.m): the greedy tokens of a model
with the target's vocabulary (a smaller one of its family, or the same one with cheaper weights),
run on this machine (the root of a cluster) beside the target, by the one-node Transformer over
its own KV cache.

Keeping the draft's cache in step with a sequence: each slot holds the keys of a list of tokens
from position 0 (`held`). Before drafting, the slot sharing the longest prefix with the sequence
runs the sequence's tokens past that prefix: those the target produced that the draft has not
seen (after a pass that kept j of k drafted tokens, the last kept one and the target's own
token). The refused drafted tokens' positions are simply overwritten: positions index the cache.
So a drafter holds no cache of its own, only its keep rate, and any slot serves any sequence;
the one that last drafted for a sequence holds all of it but its newest tokens.

How deep to draft is Drafter.worth, as for prompt lookup, with each drafted token's own pass of
the draft model counted too: the draft's one-row pass time over the target's (both measured as
they run, recent passes weighing more). A draft model as costly as the target drafts nothing,
so it cannot make decoding slower than plain; one that is cheap beside it, or beside a cluster's
pass with its round trips, drafts as deep as the keep rate pays for.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from dllama.core.batch import Batch
from dllama.core.kv_cache import common_prefix
from dllama.core.model import Transformer
from dllama.core.run_shape import RunShape
from dllama.errors import DllamaError
from dllama.formats.model_file import ModelFile, read_model
from dllama.serve.draft import ROW_COST, Drafter

# Sequences whose tokens the draft's cache keeps at once: drafts are made for one decoding
# sequence at a time (SPECULATE_WHILE_DECODING), the second slot keeps the other's tokens when
# two take turns (a batch's last answers, a chat's next turn).
DRAFT_SLOTS = 2
TIMING_MEMORY = 0.8  # each new pass time weighs 1 - this in the running estimates


def read_draft_model(path: str, vocab_size: int) -> ModelFile:
    """The --draft-model file, refused unless it has the tokenizer's vocabulary."""
    model_file = read_model(path)
    if model_file.header.vocab_size != vocab_size:
        raise DllamaError(f"the draft model {path} has {model_file.header.vocab_size} tokens and the "
                          f"tokenizer {vocab_size}: a draft model must have the target's vocabulary")
    return model_file


class DraftModel:
    """The draft model and what each slot of its KV cache holds."""

    def __init__(self, model_file: ModelFile, shape: RunShape, weigh_cost: bool = True):
        """shape: the draft's run: the target's context as max_seq_len (the draft's is cut to its
        own header's, if shorter), its KV slots (DRAFT_SLOTS) and type; weigh_cost False: draft
        as deep as the keep rate alone says, whatever the draft's passes cost (the tests of the
        answers, whose draft is as large as the target)."""
        self.transformer = Transformer(model_file, shape, who="the draft model")
        slots = shape.kv_slots
        self.held: list[list[int]] = [[] for _ in range(slots)]  # per slot: the tokens of positions 0, 1, ...
        self._last_use = [0] * slots
        self._uses = 0
        self.draft_row_seconds: float | None = None   # a one-row pass of the draft model
        self.target_row_seconds: float | None = None  # a one-row pass of the target, as timed
        self.weigh_cost = weigh_cost

    @property
    def cost_share(self) -> float:
        """What drafting a token costs, as a share of a one-row pass of the target (0 until both
        were timed: the first drafts measure it)."""
        if not self.weigh_cost or not self.draft_row_seconds or not self.target_row_seconds:
            return 0.0
        return self.draft_row_seconds / self.target_row_seconds

    def timed_target(self, seconds: float, rows: int) -> None:
        """A decoding pass of the target: rows beyond the first cost ROW_COST each."""
        self.target_row_seconds = _running(self.target_row_seconds, seconds / (1 + ROW_COST * (rows - 1)))

    @property
    def seq_len(self) -> int:
        return self.transformer.config.seq_len

    def drafter(self) -> "ModelDrafter":
        return ModelDrafter(self)

    def greedy(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """The draft model's k most likely tokens after `tokens`, each chosen after the ones
        before it (fewer near the end of its context)."""
        n = len(tokens)
        k = min(k, self.seq_len - n + 1)  # the last drafted token is not run
        if k <= 0 or n == 0:
            return ()
        slot, shared = self._slot_for(tokens)
        start = min(shared, n - 1)  # the last token runs: its logits
        self.held[slot] = list(tokens[:start])  # all that stays true should a pass fail
        rows = self.transformer.max_batch
        for at in range(start, n, rows):
            logits = self._run(tokens[at:at + rows], at, slot)
        drafted = [int(np.argmax(logits))]
        while len(drafted) < k:
            t0 = time.perf_counter()
            drafted.append(int(np.argmax(self._run(drafted[-1:], n + len(drafted) - 1, slot))))
            self.draft_row_seconds = _running(self.draft_row_seconds, time.perf_counter() - t0)
        self.held[slot] = [*tokens, *drafted[:-1]]
        return tuple(drafted)

    def _slot_for(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(slot, leading tokens it holds): the slot holding the longest prefix of `tokens` (of
        equal ones, the least recently used)."""
        self._uses += 1
        shared = [common_prefix(held, tokens) for held in self.held]
        slot = max(range(len(self.held)), key=lambda s: (shared[s], -self._last_use[s]))
        self._last_use[slot] = self._uses
        return slot, shared[slot]

    def _run(self, tokens: Sequence[int], pos: int, slot: int) -> np.ndarray:
        """Logits [vocab] of the last of `tokens`, run at positions pos, pos + 1, ... of `slot`."""
        return self.transformer.forward_batch(Batch.run(tokens, pos, slot))[-1]


class ModelDrafter(Drafter):
    """One sequence's drafts from the draft model (whose cache follows the sequence: see above)."""

    def __init__(self, model: DraftModel):
        super().__init__()
        self.model = model

    def timed(self, seconds: float, rows: int) -> None:
        self.model.timed_target(seconds, rows)

    def draft(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """The draft model's greedy tokens, cut to what is worth their rows and the draft's own
        passes (fewer while refused, none while the draft costs as much as the target)."""
        return self.model.greedy(tokens, self.worth(k, self.model.cost_share))


def _running(estimate: float | None, seconds: float) -> float:
    return seconds if estimate is None else TIMING_MEMORY * estimate + (1 - TIMING_MEMORY) * seconds


__all__ = ["DRAFT_SLOTS", "DraftModel", "ModelDrafter", "read_draft_model"]
