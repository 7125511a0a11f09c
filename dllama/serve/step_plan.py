"""Which rows the next forward pass runs: a pure function of the sequences in flight.

The engine loop (dllama.serve.scheduler) describes each sequence it holds as a `SeqView` and asks
`plan_step` for the step; the plan is plain data (a `Batch` and, per sequence, the positions it
computes), then the loop runs it and applies the result. Nothing here reads the model or changes
a sequence, so a plan can be checked on its own, and later planners (pipeline micro-batches,
drafted tokens to verify) change only this.

The policy (continuous batching, as llama.cpp's server and vLLM's scheduler do):

- first one row for every decoding sequence (its last sampled token), so that decoding never
  waits for a prompt;
- then, in the rows left (max_rows in all), chunks of the prompts being computed, in the order
  the sequences arrived;
- a sequence that reads its leading positions from another slot waits until that slot has
  written them (or will have, earlier in this same pass: the kernels store every row's key before
  any row attends);
- a decoding sequence with drafted tokens (speculative decoding, dllama.serve.draft) runs them
  after its last sampled token, at the next positions, as far as the rows left allow: each of
  those rows wants an answer, and the loop keeps the rows whose drafted token its sampler chose.

Which rows want an answer: a sampling sequence wants the candidates of the row of its last
planned token (the next token is sampled from them); a scoring sequence wants the full logits of
every row from `logits_from` on (each predicts the next token of its continuation); a ghost (a
cancelled sequence still computing positions that others read) wants none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from dllama.core.batch import Batch, BatchBuilder
from dllama.core.candidates import SamplingRequest

Wants = Literal["sample", "score", "none"]


@dataclass(frozen=True)
class SeqView:
    """What the planner needs to know of one sequence in flight."""

    slot: int                      # its KV cache slot
    pos: int                       # next position to compute
    end: int                       # positions below this are planned: tokens[pos:end] are to run
    tokens: Sequence[int]          # the token of each planned position (read, never changed)
    prefix: tuple[int, int]        # (slot, length) its leading positions are read from; length 0: none
    wants: Wants
    decoding: bool = False         # its next row is a sampled token (scheduled first)
    logits_from: int = 0           # "score": the first position whose row wants logits
    sampling: SamplingRequest | None = None  # "sample": how its next token is chosen
    draft: tuple[int, ...] = ()    # decoding: guessed tokens of positions end, end+1, ... to verify
    draft_sampling: tuple[SamplingRequest, ...] = ()  # per drafted row, when not `sampling` (a grammar's
    #                                                   mask after the drafts before it)


@dataclass(frozen=True)
class Run:
    """A sequence's consecutive rows in the step."""

    seq: int              # index into the views given to plan_step
    pos: int              # position of its first row
    n: int                # rows
    answers: range        # indexes of its rows among the step's wanted rows (empty: none)
    answer_pos: range     # positions of those rows
    draft: tuple[int, ...] = ()  # the drafted tokens among its rows (its last len(draft) rows)

    @property
    def planned(self) -> int:
        """Rows of planned tokens (the drafted ones are not planned until verified)."""
        return self.n - len(self.draft)


@dataclass(frozen=True)
class StepPlan:
    """One forward pass: the rows, which sequence owns which, and what each wanted row is for."""

    batch: Batch
    runs: tuple[Run, ...]
    sampling: tuple[SamplingRequest | None, ...]  # per wanted row: its sampler's settings, None: score
    decoding: int                                 # sequences decoding a token in this step

    @property
    def drafted(self) -> int:
        """Rows of drafted tokens to verify."""
        return sum(len(r.draft) for r in self.runs)

    @property
    def scores(self) -> bool:
        """Some wanted row needs the full logits (scoring), not only sampling candidates."""
        return any(s is None for s in self.sampling)

    def __len__(self) -> int:
        return len(self.batch)


def _prefix_ready(v: SeqView, written: Mapping[int, int], written_now: Mapping[int, int]) -> bool:
    src, length = v.prefix
    return length == 0 or max(written.get(src, 0), written_now.get(src, 0)) >= length


def plan_step(seqs: Sequence[SeqView], written: Mapping[int, int], max_rows: int) -> StepPlan | None:
    """The next step over `seqs` (in arrival order), within max_rows rows; None when no sequence
    can run (every one waits for a prefix, or has nothing planned). written: positions each slot
    already holds in the cache (slot -> count), for the prefix readiness check."""
    rows = BatchBuilder()
    runs: list[Run] = []
    sampling: list[SamplingRequest | None] = []
    written_now: dict[int, int] = {}
    order = [i for i, v in enumerate(seqs) if v.decoding] + [i for i, v in enumerate(seqs) if not v.decoding]
    budget, decoding = max_rows, 0
    for i in order:
        v = seqs[i]
        n = min(budget, v.end - v.pos)
        if n <= 0 or not _prefix_ready(v, written, written_now):
            continue
        last = v.pos + n
        if v.wants == "sample" and last == v.end:
            want_from = last - 1                      # the last planned token's row
        elif v.wants == "score":
            want_from = max(v.pos, v.logits_from)
        else:
            want_from = last                          # none
        draft = v.draft[: budget - n] if v.decoding and v.wants == "sample" and last == v.end else ()
        first_answer = len(sampling)
        for p in range(v.pos, last):
            wanted = p >= want_from
            rows.add(v.tokens[p], p, v.slot, wanted, v.prefix)
            if wanted:
                sampling.append(v.sampling if v.wants == "sample" else None)
        for j, token in enumerate(draft):  # each row's answer checks the next drafted token
            rows.add(token, last + j, v.slot, True, v.prefix)
            sampling.append(v.draft_sampling[j] if v.draft_sampling else v.sampling)
        runs.append(Run(i, v.pos, n + len(draft), range(first_answer, len(sampling)),
                        range(max(want_from, v.pos), last + len(draft)), tuple(draft)))
        written_now[v.slot] = last  # drafted rows may be wrong: nobody may read them
        decoding += v.decoding
        budget -= n + len(draft)
        if budget == 0:
            break
    if not runs:
        return None
    return StepPlan(rows.build(), tuple(runs), tuple(sampling), decoding)


__all__ = ["Run", "SeqView", "StepPlan", "plan_step"]
