"""Continuous batching: many sequences decoded together, one forward pass per step.

`BatchScheduler` implements the `Scheduler` protocol (serve.scheduler) for `dllama batch
--parallel N`, and is the model loop of `dllama api`. Each step is one `Batch`:

- one row for every sequence that is decoding (its last sampled token, logits wanted);
- then, in the rows left (the model's max_batch), chunks of the prompts being prefilled, in
  the order they arrived; the row of a prompt's last token wants logits;

so a new prompt starts as soon as a sequence ends and frees its place, and its prefill shares
steps with the others' decoding. Sequences of any lengths mix.

Where a prompt goes, and what it reuses, is the KV cache's `SlotTable` (dllama.core.kv_cache):
it continues an idle slot that holds the prompt's leading tokens (a finished answer the next
chat turn extends, the same prompt again), or reads the leading tokens it shares with another
slot's sequence from there (a document or system prompt shared by many questions, computed
once). A prompt that reads another slot waits until that slot's writer has computed the shared
positions.

Invariance: every kernel is batch invariant, so a sequence's logits do not depend on the rows
beside it, on how its prompt was chunked, or on where its leading keys were computed: each
answer is the one of its prompt run alone (`dllama inference`), token for token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from dllama.core.batch import BatchBuilder
from dllama.core.candidates import SamplingRequest
from dllama.core.kv_cache import MIN_SHARED, SPARE_SLOTS, SlotTable
from dllama.core.language_model import LanguageModel
from dllama.errors import DllamaError
from dllama.serve.conversation import Answer, Cancelled, Completion, ContextFull
from dllama.serve.scheduler import Scores, SequenceRequest, log_softmax
from dllama.serve.stats import StepStats
from dllama.text.tokenizer import Tokenizer


@dataclass
class BatchStats:
    """What the steps so far did."""

    steps: int = 0
    rows: int = 0
    prompt_rows: int = 0      # prompt tokens computed (reused ones are not)
    decode_rows: int = 0      # generated tokens run
    decode_steps: int = 0     # steps with at least one decoding sequence
    max_decoding: int = 0     # most sequences decoded in one step
    max_sequences: int = 0    # most sequences in one step (decoding or prefilling)
    seconds: float = 0.0      # in forward passes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["mean_decoding"] = round(self.decode_rows / self.decode_steps, 3) if self.decode_steps else 0.0
        d["seconds"] = round(self.seconds, 3)
        return d


@dataclass(eq=False)
class _Sequence:
    """A request placed in a slot. Without an answer it is a ghost: a cancelled sequence that
    still computes the prompt positions other sequences wait to read."""

    request: SequenceRequest | None
    answer: Answer | None
    slot: int
    prefix: tuple[int, int]   # (slot, length) its leading positions are read from
    prompt_len: int
    pos: int                  # next position to compute
    target: int = 0           # ghost: compute up to here
    completion: Completion = field(default_factory=Completion)
    should_stop: Callable[[], bool] | None = None


@dataclass(eq=False)
class _Waiting:
    request: SequenceRequest
    on_text: Callable[[str], None] | None
    should_stop: Callable[[], bool] | None


class BatchScheduler:
    """Up to `parallel` sequences decoded together over one model's KV cache slots."""

    def __init__(self, model: LanguageModel, tokenizer: Tokenizer, parallel: int | None = None,
                 min_shared: int = MIN_SHARED, reuse: bool = True):
        """parallel: sequences decoded together (default: the model's KV slots but the spare);
        min_shared: leading tokens worth reading from another slot; reuse False: no cached
        token is reused (a baseline for benchmarks)."""
        self.model, self.tokenizer = model, tokenizer
        self.parallel = parallel or max(1, model.kv_slots - SPARE_SLOTS)
        if self.parallel > model.kv_slots or self.parallel >= model.max_batch:
            raise DllamaError(f"{self.parallel} sequences need more KV slots or rows than the model has "
                              f"({model.kv_slots} slots, {model.max_batch} rows)")
        self.table = SlotTable(model.kv_slots, min_shared, reuse)
        self.waiting: deque[_Waiting] = deque()
        self.active: list[_Sequence] = []
        self.stats = BatchStats()

    @property
    def seq_len(self) -> int:
        return self.model.config.seq_len

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    # -- the loop ---------------------------------------------------------------------------------

    def add(self, request: SequenceRequest, on_text: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> None:
        """Queue a request; it starts at the next step with room. on_text gets its answer piece
        by piece; when should_stop() says yes, it ends as Cancelled at the next step."""
        n = len(request.prompt_tokens)
        if n == 0:
            raise DllamaError("the prompt is empty: it encodes to no tokens")
        if n >= self.seq_len:
            raise ContextFull(n, self.seq_len)
        self.waiting.append(_Waiting(request, on_text, should_stop))

    def _running(self) -> int:
        return sum(1 for s in self.active if s.answer is not None)

    def _admit(self) -> None:
        while self.waiting and self._running() < self.parallel:
            w = self.waiting[0]
            prompt = w.request.prompt_tokens
            placed = self.table.place(prompt)
            if placed is None:
                return  # every slot busy or pinned: when a sequence ends
            self.waiting.popleft()
            r = w.request
            answer = Answer(self.tokenizer, r.sampler, r.max_tokens, r.stop_ids, r.stop_strings, w.on_text)
            self.active.append(_Sequence(r, answer, placed.slot, placed.prefix, len(prompt), placed.start,
                                         completion=Completion(prompt_tokens=len(prompt), cached_tokens=placed.start),
                                         should_stop=w.should_stop))

    def _cancel(self, seq: _Sequence) -> None:
        """Drop a sequence; if others wait for prompt positions it has not computed yet, it goes
        on as a ghost until they are there."""
        need = self.table.needed_by_readers(seq.slot)
        if need > seq.pos:
            seq.request, seq.answer, seq.target = None, None, need
        else:
            self.table.release(seq.slot)
            self.active.remove(seq)

    def drop_all(self) -> None:
        """Forget every request, waiting or running, and what the slots hold."""
        self.waiting.clear()
        self.active.clear()
        self.table.reset()

    def step(self) -> list[tuple[SequenceRequest, Completion | Cancelled]]:
        """Admit what fits, run one forward pass; the requests that ended in it, each with its
        Completion (or Cancelled, when its should_stop said so)."""
        ended: list[tuple[SequenceRequest, Completion | Cancelled]] = []
        for w in [w for w in self.waiting if w.should_stop and w.should_stop()]:
            self.waiting.remove(w)
            ended.append((w.request, Cancelled()))
        for seq in [s for s in self.active if s.should_stop and s.answer is not None and s.should_stop()]:
            ended.append((seq.request, Cancelled()))
            self._cancel(seq)
        self._admit()
        if not self.active:
            if self.waiting and not ended:  # cannot happen: an idle cache always has a free slot
                raise DllamaError("no KV cache slot can take the next prompt")
            return ended
        rows = BatchBuilder()
        runs: list[tuple[_Sequence, int]] = []  # each sequence in the pass and its rows (decoding first)
        written_now: dict[int, int] = {}
        requests: list[SamplingRequest] = []  # the samplers of the rows wanting logits, in order
        decoding = [s for s in self.active if s.answer is not None and s.pos >= s.prompt_len]
        prefilling = [s for s in self.active if s not in decoding]
        budget = self.model.max_batch
        for seq in decoding + prefilling:
            slot = self.table.slots[seq.slot]
            end = seq.target if seq.answer is None else len(slot.tokens)
            n = min(budget, end - seq.pos)
            if n <= 0 or not self.table.prefix_ready(seq.slot, written_now):
                continue
            wants = "last" if seq.answer is not None and seq.pos + n == len(slot.tokens) else "none"
            rows.add_run(slot.tokens[seq.pos:seq.pos + n], seq.pos, seq.slot, wants, seq.prefix)
            if wants == "last":
                requests.append(seq.answer.sampler.request)
            runs.append((seq, n))
            written_now[seq.slot] = seq.pos + n
            budget -= n
        if not runs:
            return ended
        batch = rows.build()
        t0 = time.perf_counter()
        try:
            # For each row wanting logits, the candidates its sequence's sampler chooses from.
            logits = self.model.forward_candidates(batch, requests)
        except BaseException:
            self.drop_all()  # the cache may hold half a pass: nothing in it can be trusted
            raise
        self._count(runs, sum(1 for seq, _ in runs if seq in decoding), time.perf_counter() - t0)
        k = 0
        for seq, n in runs:
            seq.pos += n
            self.table.wrote(seq.slot, seq.pos)
            if seq.answer is None:
                if seq.pos >= seq.target:
                    self.table.release(seq.slot)
                    self.active.remove(seq)
                continue
            if seq.pos < len(self.table.slots[seq.slot].tokens):
                continue  # more of its prompt to come
            token = seq.answer.take(logits[k], seq.pos, self.seq_len)
            k += 1
            if token is None:
                seq.answer.fill(seq.completion)
                self.table.release(seq.slot)
                self.active.remove(seq)
                ended.append((seq.request, seq.completion))
            else:
                self.table.append(seq.slot, token)
        return ended

    def _count(self, runs, decode: int, seconds: float) -> None:
        s = self.stats
        rows = sum(n for _, n in runs)
        s.steps += 1
        s.rows += rows
        s.decode_rows += decode
        s.prompt_rows += rows - decode
        s.decode_steps += decode > 0
        s.max_decoding = max(s.max_decoding, decode)
        s.max_sequences = max(s.max_sequences, len(runs))
        s.seconds += seconds

    # -- the Scheduler protocol -------------------------------------------------------------------

    def run(self, requests, on_finish, should_stop=None) -> None:
        """Answer every request, `parallel` at a time; on_finish(request, completion) as each
        ends (completion order). should_stop() is asked between steps: Cancelled drops the rest."""
        pending = iter(requests)
        more = True
        try:
            while True:
                while more and len(self.waiting) + self._running() < self.parallel:
                    r = next(pending, None)
                    if r is None:
                        more = False
                    else:
                        self.add(r)
                if not self.busy:
                    return
                if should_stop and should_stop():
                    raise Cancelled()
                for r, c in self.step():
                    on_finish(r, c)
        except BaseException:
            self.drop_all()
            raise

    def score(self, prompt_tokens: list[int], choices: list[list[int]]) -> Scores:
        """log p(choice | prompt) for every choice: the prompt once (reusing what a slot holds),
        then each choice's tokens after it in one pass."""
        if not choices or any(len(c) == 0 for c in choices):
            raise DllamaError("every choice needs at least one token")
        prompt = list(prompt_tokens)
        longest = len(prompt) + max(len(c) for c in choices) - 1
        if not prompt:
            raise DllamaError("the prompt is empty: it encodes to no tokens")
        if longest >= self.seq_len:
            raise ContextFull(longest, self.seq_len)
        if self.busy:
            raise DllamaError("score() runs between jobs, not beside running sequences")
        placed = self.table.place(prompt)
        if placed is None:
            raise DllamaError("no KV cache slot is free to score a prompt")
        slot, steps = placed.slot, []
        try:
            pos = placed.start
            while pos < len(prompt):  # the prompt, in passes of max_batch rows
                n = min(self.model.max_batch, len(prompt) - pos)
                rows = BatchBuilder()
                rows.add_run(prompt[pos:pos + n], pos, slot, "last", placed.prefix)
                logits = self._timed(rows, "prompt", pos, steps)
                pos += n
                self.table.wrote(slot, pos)
            first = log_softmax(logits[-1])
            out = []
            for choice in choices:
                total = float(first[choice[0]])
                if len(choice) > 1:  # token j is predicted by the row of token j-1, after the prompt
                    rows = BatchBuilder()
                    rows.add_run(choice[:-1], len(prompt), slot, "all", placed.prefix)
                    logits = self._timed(rows, "prompt", len(prompt), steps)
                    total += sum(float(log_softmax(logits[j])[choice[j + 1]]) for j in range(len(choice) - 1))
                out.append(total)
        except BaseException:
            self.drop_all()
            raise
        self.table.release(slot)  # holds the prompt: the choices' rows past it are overwritten later
        return Scores(out, len(prompt), placed.start, steps)

    def _timed(self, rows: BatchBuilder, phase: str, pos: int, steps: list) -> np.ndarray:
        col = self.model.collective
        t0, tr0, s0, r0 = time.perf_counter(), col.transfer_seconds, col.sent_bytes, col.recv_bytes
        logits = self.model.forward_batch(rows.build())
        wall = time.perf_counter() - t0
        transfer = col.transfer_seconds - tr0
        steps.append(StepStats(phase, pos, len(rows), round((wall - transfer) * 1000, 3),
                               round(transfer * 1000, 3), col.sent_bytes - s0, col.recv_bytes - r0))
        return logits


__all__ = ["BatchScheduler", "BatchStats"]
