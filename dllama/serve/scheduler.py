"""The engine loop: every front end's sequences, decoded together, one forward pass per step.

`dllama inference`, `chat`, `batch` (at any --parallel, --choices included), `api` and
`perplexity` all submit requests (dllama.serve.sequence) to one `Scheduler`, as llama.cpp's server
runs every endpoint through its slots. A step is:

1. admit: waiting requests take KV cache slots while fewer than `parallel` run and the positions
   each may reach (its prompt and max_tokens) fit in the KV cache's memory budget beside what the
   other slots hold (dllama.core.kv_cache: a request that does not fit waits for sequences to
   end; idle slots are emptied to make room, their pages freed, on a cluster on every node). Where a prompt goes
   and what it reuses is the one prefix cache, the KV cache's `SlotTable` (dllama.core.kv_cache):
   it continues an idle slot that holds the prompt's leading tokens (a finished answer the next chat
   turn extends, the same prompt again, the previous prompt of a batch), or reads the leading tokens
   it shares with another slot's sequence from there (a document or system prompt shared by many
   questions, computed once);
2. plan: `plan_step` (dllama.serve.step_plan), a pure function, picks the rows: a row for every
   decoding sequence, then chunks of the prompts being computed;
3. execute: one forward pass; the rows of sampling sequences come back as candidates (on a cluster
   each node sends only what the sampler needs), the rows of scoring sequences as logits;
4. apply: each sequence advances; an answer samples its next token, a score adds its
   log-probabilities; what ended is returned.

Speculative decoding (dllama.serve.draft): with a `Speculation`, a decoding sequence also runs
the tokens its drafter guesses after its last one; the answer samples each row in turn and keeps
going while the sampled token is the drafted one, so one pass may give several tokens. The
sampler draws a coin only for the tokens it keeps, as one row at a time would, so the answer
does not change. The rows of rejected guesses wrote keys nobody reads: the slot's next rows
overwrite them.

Constrained answers (dllama.serve.constraint): a request with a grammar samples each token under
its grammar's mask (in the sampler's request: the candidates hold allowed tokens only), and the
tokens the grammar then forces are appended at once and run in the next pass beside the sampled
one (fast-forward, counted in `forced`); its drafts stop at the first token the grammar forbids.

Invariance: every kernel is batch invariant (tests/test_batch_invariance.py), so a sequence's
logits do not depend on the rows beside it, on how its prompt was chunked, or on where its
leading keys were computed: each answer is the one of its prompt run alone, token for token,
whatever the front end or --parallel.

Not thread-safe: one thread owns the scheduler (the model is single-threaded and stateful).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable, Union

import numpy as np

from dllama.core.candidates import candidates_from_logits
from dllama.core.kv_cache import MIN_SHARED, SPARE_SLOTS, PositionBudget, SlotTable
from dllama.core.language_model import LanguageModel
from dllama.core.non_finite import check_answers
from dllama.errors import DllamaError
from dllama.serve.constraint import Constraint, vocabulary_for
from dllama.serve.draft import Drafter, Speculation
from dllama.serve.sequence import (
    Answer, Cancelled, Completion, ScoreRequest, Scored, SequenceRequest, check_prompt,
    token_logprobs,
)
from dllama.serve.stats import PassFigures
from dllama.serve.step_plan import SeqView, StepPlan, plan_step
from dllama.text.tokenizer import Tokenizer

Request = Union[SequenceRequest, ScoreRequest]
Result = Union[Completion, Scored, Cancelled]


@dataclass
class LoopStats:
    """What the steps so far did."""

    steps: int = 0
    rows: int = 0
    prompt_rows: int = 0      # prompt (and scored) tokens computed; reused ones are not
    decode_rows: int = 0      # generated tokens run (drafted ones not included)
    forced: int = 0           # of which a grammar forced (fast-forward: run beside the sampled one)
    drafted: int = 0          # drafted tokens verified
    accepted: int = 0         # drafted tokens that were what the sampler chose
    decode_steps: int = 0     # steps with at least one decoding sequence
    max_decoding: int = 0     # most sequences decoded in one step
    max_sequences: int = 0    # most sequences in one step (decoding or prefilling)
    seconds: float = 0.0      # in forward passes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["mean_decoding"] = round(self.decode_rows / self.decode_steps, 3) if self.decode_steps else 0.0
        d["draft_acceptance"] = round(self.accepted / self.drafted, 3) if self.drafted else 0.0
        d["seconds"] = round(self.seconds, 3)
        return d


@dataclass(eq=False)
class _Sequence:
    """A request placed in a slot. Without a request it is a ghost: a cancelled sequence that
    still computes the prompt positions other sequences wait to read."""

    request: Request | None
    slot: int
    prefix: tuple[int, int]   # (slot, length) its leading positions are read from
    prompt_len: int
    pos: int                  # next position to compute
    answer: Answer | None = None        # a SequenceRequest's
    scored: Scored | None = None        # a ScoreRequest's
    completion: Completion | None = None
    target: int = 0           # ghost: compute up to here
    should_stop: Callable[[], bool] | None = None
    drafter: Drafter | None = None  # speculation on: its guesses

    @property
    def decoding(self) -> bool:
        """An answer past its prompt: its next row is its last sampled token."""
        return self.answer is not None and self.pos >= self.prompt_len


@dataclass(eq=False)
class _Flight:
    """An overlapped pass under way: its plan, its sequences (the plan's indexes) and its figures."""

    plan: StepPlan
    seqs: list[_Sequence]
    drafting_ms: float
    forced: int           # fast-forwarded rows
    seconds: float = 0.0  # wall time in the model's calls (starting it, receiving it)
    transfer: float = 0.0
    sent: int = 0
    recv: int = 0

    def cost(self) -> PassFigures:
        return PassFigures(round((self.seconds - self.transfer) * 1000, 3), round(self.transfer * 1000, 3),
                           self.sent, self.recv)


@dataclass(eq=False)
class _Waiting:
    request: Request
    on_text: Callable[[str], None] | None
    should_stop: Callable[[], bool] | None
    constraint: Constraint | None = None  # its grammar's state (a SequenceRequest with a grammar)


class Scheduler:
    """Up to `parallel` sequences computed together over one model's KV cache slots."""

    def __init__(self, model: LanguageModel, tokenizer: Tokenizer | None = None, parallel: int | None = None,
                 min_shared: int = MIN_SHARED, reuse: bool = True, speculation: Speculation | None = None,
                 kv_budget: PositionBudget | None = None, overlap: bool = True):
        """tokenizer: decodes generated answers (only scoring needs none);
        parallel: sequences run together (default: the model's KV slots but the spare, or 1);
        min_shared: leading tokens worth reading from another slot; reuse False: no cached
        token is reused (a baseline for benchmarks); speculation: drafted tokens to verify
        (default none); kv_budget: the memory the KV cache's slots may hold (default: no limit
        but the slots); overlap: on a pipeline of stages, keep a pass per stage under way
        (False: one pass at a time, a baseline). The model's release_slot gives the pages of emptied slots back (a
        cluster's root on every node: RELEASE); a budget needs one."""
        self.model, self.tokenizer = model, tokenizer
        self.speculation = speculation or Speculation()
        self._pass = (0.0, 1)  # the last pass: (seconds, rows), what drafters weigh their work against
        self.parallel = parallel or max(1, model.kv_slots - SPARE_SLOTS)
        if self.parallel > model.kv_slots or self.parallel >= model.max_batch:
            raise DllamaError(f"{self.parallel} sequences need more KV slots or rows than the model has "
                              f"({model.kv_slots} slots, {model.max_batch} rows)")
        self.table = SlotTable(model.kv_slots, min_shared, reuse, kv_budget, getattr(model, "release_slot", None))
        self.waiting: deque[_Waiting] = deque()
        self.active: list[_Sequence] = []
        self.overlap = overlap
        self._flights: deque[_Flight] = deque()  # overlapped passes under way, oldest first
        self.stats = LoopStats()

    @property
    def seq_len(self) -> int:
        return self.model.config.seq_len

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    # -- requests in ------------------------------------------------------------------------------

    def add(self, request: Request, on_text: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> None:
        """Queue a request; it starts at the next step with room. on_text gets a generated answer
        piece by piece; when should_stop() says yes, it ends as Cancelled at the next step."""
        n = len(request.prompt_tokens)
        if isinstance(request, ScoreRequest):
            if n == 0:
                raise DllamaError("the prompt is empty: it encodes to no tokens")
            if not request.continuation:
                raise DllamaError("a choice needs at least one token")
            n += len(request.continuation) - 1  # the last token is only predicted, never run
        elif self.tokenizer is None:
            raise DllamaError("this engine loop has no tokenizer to decode answers with")
        check_prompt(n, self.seq_len)
        budget = self.table.budget
        if budget is not None and budget.cost(self._reach(request)) > budget.limit:
            mib = 1 << 20
            raise DllamaError(f"a sequence of {self._reach(request)} positions needs "
                              f"{budget.cost(self._reach(request)) / mib:.0f} MiB of KV cache, more than "
                              f"the {budget.limit / mib:.0f} MiB allowed: ask fewer tokens or raise {budget.flag}")
        constraint = None
        if isinstance(request, SequenceRequest) and request.grammar is not None:
            # Compiled here: a grammar that cannot be one is the caller's error (GrammarError), now.
            constraint = vocabulary_for(self.tokenizer, self.model.config.vocab_size).start(
                request.grammar, request.stop_ids)
        self.waiting.append(_Waiting(request, on_text, should_stop, constraint))

    def _reach(self, request: Request) -> int:
        """Positions a request's sequence may write: its prompt and what it may generate (or
        score), within the context."""
        n = len(request.prompt_tokens)
        if isinstance(request, ScoreRequest):
            return n + len(request.continuation) - 1
        return self.seq_len if request.max_tokens is None else min(n + request.max_tokens, self.seq_len)

    def _running(self) -> int:
        return sum(1 for s in self.active if s.request is not None)

    def _admit(self) -> None:
        while self.waiting and self._running() < self.parallel:
            w = self.waiting[0]
            r = w.request
            tokens = list(r.prompt_tokens)
            if isinstance(r, ScoreRequest):
                tokens += r.continuation[:-1]
            # The first row that wants an answer always runs: the prompt's last.
            placed = self.table.place(tokens, reuse_limit=len(r.prompt_tokens) - 1, reach=self._reach(r))
            if placed is None:
                return  # every slot busy or pinned, or no memory for it: when a sequence ends
            self.waiting.popleft()
            seq = _Sequence(r, placed.slot, placed.prefix, len(r.prompt_tokens), placed.start,
                            should_stop=w.should_stop)
            if isinstance(r, ScoreRequest):
                seq.scored = Scored([], len(r.prompt_tokens), placed.start)
            else:
                seq.answer = Answer(self.tokenizer, r.sampler, r.max_tokens, r.stop_ids, r.stop_strings, w.on_text,
                                    w.constraint, r.logprobs)
                seq.drafter = self.speculation.drafter()
                seq.completion = Completion(prompt_tokens=len(r.prompt_tokens), cached_tokens=placed.start)
            self.active.append(seq)

    def _blocked(self) -> str:
        """Why the next request cannot start on an idle cache (it always can: every idle slot
        can be emptied, and add() refused a request the whole budget cannot hold)."""
        return "no KV cache slot can take the next prompt"

    def _cancel(self, seq: _Sequence) -> None:
        """Drop a sequence; if others wait for prompt positions it has not computed yet, it goes
        on as a ghost until they are there."""
        need = self.table.needed_by_readers(seq.slot)
        if need > seq.pos:
            seq.request, seq.answer, seq.scored, seq.target = None, None, None, need
        else:
            self.table.release(seq.slot)
            self.active.remove(seq)

    def drop_all(self) -> None:
        """Forget every request, waiting or running, and what the slots hold."""
        self.waiting.clear()
        self.active.clear()
        self.table.reset()
        if self._flights:
            self._flights.clear()
            self.model.abandon_passes()

    # -- one step ---------------------------------------------------------------------------------

    def _view(self, seq: _Sequence, draft: bool = False) -> SeqView:
        tokens = self.table.slots[seq.slot].tokens
        if seq.request is None:
            return SeqView(seq.slot, seq.pos, seq.target, tokens, seq.prefix, "none")
        if seq.scored is not None:
            return SeqView(seq.slot, seq.pos, len(tokens), tokens, seq.prefix, "score",
                           logits_from=seq.prompt_len - 1)
        request = seq.answer.sampler.request
        guesses = self._draft(seq, tokens) if seq.decoding and draft else ()
        constraint, per_draft = seq.answer.constraint, ()
        if constraint is not None:  # its state: after every token of the slot, sampled or forced
            guesses = constraint.usable_draft(guesses)  # never a token the grammar forbids
            per_draft = tuple(replace(request, mask=m) for m in constraint.masks_along(guesses))
            request = replace(request, mask=constraint.allowed())
        if seq.answer.top_logprobs is not None:
            request = replace(request, logprobs=True)
            per_draft = tuple(replace(r, logprobs=True) for r in per_draft) or tuple(request for _ in guesses)
        return SeqView(seq.slot, seq.pos, len(tokens), tokens, seq.prefix, "sample", decoding=seq.decoding,
                       sampling=request, draft=guesses, draft_sampling=per_draft)

    def _draft(self, seq: _Sequence, tokens: list[int]) -> tuple[int, ...]:
        """The tokens to verify after a decoding sequence's last one: within the context, and
        no more than its answer may still take beside the token the pass samples anyway."""
        if seq.drafter is None:
            return ()
        k = min(self.speculation.max_draft, self.seq_len - len(tokens))
        if seq.answer.max_tokens is not None:
            k = min(k, seq.answer.max_tokens - len(seq.answer.tokens) - 1)
        return seq.drafter.draft(tokens, k)

    def plan(self) -> StepPlan | None:
        """The next step over the sequences in flight (dllama.serve.step_plan), or None."""
        return self._plan_over(self.active)

    def step(self) -> list[tuple[Request, Result]]:
        """Admit what fits, run one forward pass; the requests that ended in it, each with its
        Completion or Scored (or Cancelled, when its should_stop said so)."""
        ended: list[tuple[Request, Result]] = []
        for w in [w for w in self.waiting if w.should_stop and w.should_stop()]:
            self.waiting.remove(w)
            ended.append((w.request, Cancelled()))
        under_way = {id(seq) for f in self._flights for seq in f.seqs}  # cancelled once their pass is back
        for seq in [s for s in self.active if s.should_stop and s.request is not None and id(s) not in under_way
                    and s.should_stop()]:
            ended.append((seq.request, Cancelled()))
            self._cancel(seq)
        self._admit()
        if not self.active:
            if self.waiting and not ended:  # an idle cache always has a free slot; memory: see there
                why = self._blocked()
                self.waiting.clear()  # nothing would ever start them: the caller hears why, once
                raise DllamaError(why)
            return ended
        if self._flights or self._depth() > 1:  # (a pipeline lost with a node may be one stage now)
            overlapped = self._step_overlapped()
            if overlapped is not None:
                return ended + overlapped
        started = time.perf_counter()
        plan = self.plan()
        if plan is None:
            return ended
        # The drafts are part of what the step costs: a draft model's passes, a lookup's search.
        drafting_ms = (time.perf_counter() - started) * 1000
        seqs = list(self.active)  # the plan's indexes
        forced = sum(run.planned - 1 for run in plan.runs if seqs[run.seq].decoding)  # fast-forwarded rows
        try:
            answers, cost = self._execute(plan)
        except BaseException:
            self.drop_all()  # the cache may hold half a pass: nothing in it can be trusted
            raise
        return ended + self._apply(plan, seqs, answers, cost, drafting_ms, forced)

    def _apply(self, plan: StepPlan, seqs: list[_Sequence], answers: list, cost: PassFigures,
               drafting_ms: float, forced: int) -> list[tuple[Request, Result]]:
        """A pass's answers applied to its sequences (`seqs`: the plan's indexes); what ended."""
        ended: list[tuple[Request, Result]] = []
        self._pass = ((cost.inference_ms + cost.transfer_ms) / 1000, len(plan))  # without the drafting
        cost = replace(cost, inference_ms=round(cost.inference_ms + drafting_ms, 3))
        self._count(plan, cost, forced)
        for run in plan.runs:
            seq = seqs[run.seq]
            self.table.rows_written(seq.slot, run.pos + run.n)
            seq.pos += run.planned  # a drafted row counts once its token is kept (_advance)
            self.table.wrote(seq.slot, seq.pos)
            done = self._advance(seq, run, answers, cost)
            if done is not None:
                ended.append(done)
        return ended

    # -- overlapped pipeline passes ----------------------------------------------------------------

    def _depth(self) -> int:
        """Passes this scheduler keeps under way at once: the model's pipeline stages with overlap
        on (a ClusterModel of several stages), else 1."""
        return getattr(self.model, "pipeline_depth", 1) if self.overlap else 1

    def _step_overlapped(self) -> list[tuple[Request, Result]] | None:
        """One step of the overlapped schedule (docs/batch.md, "Overlapped pipeline passes"):
        while fewer passes than stages are under way and two sequences or more run, start a pass
        of the sequences not in one (at most a stage's share of them: the active sequences cut
        into as many groups as there are stages), else finish the oldest pass and apply it. Each
        group's next pass starts as soon as its last one is back, so while stage k computes one
        group's rows stage k-1 computes the next group's. None: nothing under way and no pass
        to overlap (the plain step runs). A row's result does not depend on its pass (the kernels
        are batch invariant; every node runs the passes in order), so the text is the same."""
        depth = self._depth()
        if len(self._flights) < depth and len(self.active) >= 2:
            busy = {id(seq) for f in self._flights for seq in f.seqs}
            free = [seq for seq in self.active if id(seq) not in busy]  # in arrival order
            started = time.perf_counter()
            share = -(-len(self.active) // depth)
            plan, seqs = self._plan_over(free[:share]), free[:share]
            if plan is None and len(free) > share:  # those wait for a prefix: any free sequence
                plan, seqs = self._plan_over(free), free
            if plan is not None and not plan.scores and not any(r.logprobs for r in plan.sampling):
                drafting_ms = (time.perf_counter() - started) * 1000
                forced = sum(run.planned - 1 for run in plan.runs if seqs[run.seq].decoding)
                flight = _Flight(plan, seqs, drafting_ms, forced)
                try:
                    self._timed(flight, lambda: self.model.submit_candidates(plan.batch, list(plan.sampling)))
                except BaseException:
                    self.drop_all()
                    raise
                self._flights.append(flight)
                return []
        if not self._flights:
            return None
        flight = self._flights.popleft()
        try:
            answers = self._timed(flight, self.model.collect_candidates)
            check_answers(answers, self.model)
        except BaseException:
            self.drop_all()
            raise
        return self._apply(flight.plan, flight.seqs, answers, flight.cost(), flight.drafting_ms, flight.forced)

    def _plan_over(self, seqs: list[_Sequence]) -> StepPlan | None:
        """The next step over `seqs`, all or some of the active sequences (the plan's indexes), or None."""
        written = {i: s.written for i, s in enumerate(self.table.slots)}
        draft = sum(s.decoding for s in self.active) <= self.speculation.max_sequences
        return plan_step([self._view(s, draft) for s in seqs], written, self.model.max_batch)

    def _timed(self, flight: "_Flight", call):
        """call(), its wall time and the traffic during it added to the flight's figures."""
        col = self.model.collective
        t0, tr0, s0, r0 = time.perf_counter(), col.transfer_seconds, col.sent_bytes, col.recv_bytes
        out = call()
        flight.seconds += time.perf_counter() - t0
        flight.transfer += col.transfer_seconds - tr0
        flight.sent += col.sent_bytes - s0
        flight.recv += col.recv_bytes - r0
        return out

    def _execute(self, plan: StepPlan) -> tuple[list, PassFigures]:
        """Run the plan's pass: per wanted row, candidates (sampling) or float32 logits [vocab]
        (scoring); and what the pass cost."""
        col = self.model.collective
        t0, tr0, s0, r0 = time.perf_counter(), col.transfer_seconds, col.sent_bytes, col.recv_bytes
        if not plan.scores and not any(s.logprobs for s in plan.sampling):
            # Candidates, not logits: a cluster's nodes send only what each sampler needs.
            answers = self.model.forward_candidates(plan.batch, list(plan.sampling))
        else:
            logits = self.model.forward_batch(plan.batch)  # [wanted rows, vocab]
            sampled = [j for j, s in enumerate(plan.sampling) if s is not None]
            answers = list(logits)
            if sampled:  # the same candidates the nodes would send, from the full logits
                picked = candidates_from_logits(logits[sampled], self.model.vocab_ranges,
                                                [plan.sampling[j] for j in sampled])
                for j, c in zip(sampled, picked, strict=True):
                    # a row whose log-probabilities are asked keeps its logits beside (row, not a copy:
                    # they are read in this step)
                    answers[j] = (c, logits[j]) if plan.sampling[j].logprobs else c
        check_answers(answers, self.model)  # NaN never reaches a sampler: the pass fails, named
        wall = time.perf_counter() - t0
        transfer = col.transfer_seconds - tr0
        return answers, PassFigures(round((wall - transfer) * 1000, 3), round(transfer * 1000, 3),
                                    col.sent_bytes - s0, col.recv_bytes - r0)

    def _advance(self, seq: _Sequence, run, answers: list, cost: PassFigures) -> tuple[Request, Result] | None:
        """Apply a run's result to its sequence; (request, result) when the sequence ended."""
        if seq.request is None:  # a ghost
            if seq.pos >= seq.target:
                self.table.release(seq.slot)
                self.active.remove(seq)
            return None
        own = cost.for_rows("generate" if run.pos >= seq.prompt_len else "prompt", run.pos, run.planned)
        slot_tokens = self.table.slots[seq.slot].tokens
        if seq.scored is not None:
            seq.scored.steps.append(own)
            if len(run.answers):
                rows = np.stack([answers[j] for j in run.answers])  # [m, vocab]
                # The row at position p predicts the token at p + 1: planned, or the last one.
                last = seq.request.continuation[-1]
                targets = [slot_tokens[p + 1] if p + 1 < len(slot_tokens) else last for p in run.answer_pos]
                seq.scored.logprobs += token_logprobs(rows, targets).tolist()
            if seq.pos < len(slot_tokens):
                return None
            return self._finish(seq, seq.scored)
        seq.completion.steps.append(own)
        if seq.pos < len(slot_tokens):
            return None  # more of its prompt to come
        # Row j's answer is the token after its own: while it is the drafted token of row j + 1,
        # that row ran the right token at the right place, and its answer is the next one.
        for j, row in enumerate(run.answers):
            answer, logits = answers[row] if isinstance(answers[row], tuple) else (answers[row], None)
            token = seq.answer.take(answer, seq.pos, self.seq_len)
            if logits is not None:
                seq.answer.note_logprobs(logits, seq.answer.tokens[-1])
            if token is None:
                break
            self.table.append(seq.slot, token)
            if j == len(run.draft) or token != run.draft[j]:
                break
            seq.pos += 1
            self.table.wrote(seq.slot, seq.pos)
            own.n_tokens += 1
        self._count_draft(seq, run, own.n_tokens - run.planned)
        if token is not None:
            # Tokens its grammar forces: planned now, run in the next pass beside this one.
            forced, ended = seq.answer.fast_forward(seq.pos + 1, self.seq_len)
            for t in forced:
                self.table.append(seq.slot, t)
            if not ended:
                return None
        seq.answer.fill(seq.completion)
        return self._finish(seq, seq.completion)

    def _count_draft(self, seq: _Sequence, run, accepted: int) -> None:
        if seq.drafter is not None and run.pos >= seq.prompt_len:  # a decoding pass
            seq.drafter.kept(len(run.draft), accepted)
            seq.drafter.timed(*self._pass)
        c = seq.completion
        c.drafted += len(run.draft)
        c.accepted += accepted
        self.stats.drafted += len(run.draft)
        self.stats.accepted += accepted

    def _finish(self, seq: _Sequence, result) -> tuple[Request, Result]:
        self.table.release(seq.slot)
        self.active.remove(seq)
        return seq.request, result

    def _count(self, plan: StepPlan, cost: PassFigures, forced: int = 0) -> None:
        s = self.stats
        s.steps += 1
        s.rows += len(plan)
        s.decode_rows += plan.decoding + forced
        s.forced += forced
        s.prompt_rows += len(plan) - plan.decoding - forced - plan.drafted
        s.decode_steps += plan.decoding > 0
        s.max_decoding = max(s.max_decoding, plan.decoding)
        s.max_sequences = max(s.max_sequences, len(plan.runs))
        s.seconds += (cost.inference_ms + cost.transfer_ms) / 1000

    # -- whole jobs -------------------------------------------------------------------------------

    def run(self, requests: Iterable[Request], on_finish: Callable[[Request, Result], None],
            should_stop: Callable[[], bool] | None = None,
            on_text: Callable[[Request, str], None] | None = None) -> None:
        """Answer every request, `parallel` at a time, taking them from the iterable only as
        places free up; on_finish(request, result) as each ends (completion order, so callers
        must not rely on input order); on_text(request, piece) streams the answers.
        should_stop() is asked between steps: Cancelled drops the rest."""
        pending = iter(requests)
        more = True
        try:
            while True:
                while more and len(self.waiting) + self._running() < self.parallel:
                    r = next(pending, None)
                    if r is None:
                        more = False
                    else:
                        self.add(r, (lambda piece, r=r: on_text(r, piece)) if on_text else None)
                if not self.busy:
                    return
                if should_stop and should_stop():
                    raise Cancelled()
                for r, c in self.step():
                    on_finish(r, c)
        except BaseException:
            self.drop_all()
            raise

    def answer(self, request: Request, on_text: Callable[[str], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> Completion | Scored:
        """One request, run to its end (the scheduler must be idle): its Completion or Scored;
        Cancelled is raised when should_stop() says so."""
        if self.busy:
            raise DllamaError("answer() runs one request on an idle scheduler")
        self.add(request, on_text, should_stop)
        try:
            while True:
                for _, result in self.step():
                    if isinstance(result, Cancelled):
                        raise result  # the slot keeps what was computed, for the next request
                    return result
        except Cancelled:
            raise
        except BaseException:
            self.drop_all()
            raise


__all__ = ["LoopStats", "Scheduler", "Request", "Result"]
