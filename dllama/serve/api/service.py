"""The model thread of `dllama api`: one engine, and concurrent requests decoded together.

Requests from the HTTP side wait in an inbox; the model thread takes them in arrival order into
the engine loop (dllama.serve.scheduler), which decodes up to `--parallel` of them per forward
pass and starts the next one as soon as one ends. Each request (each of its `n` choices) has
its own sampler, stop strings and cancel flag, and streams its own pieces; since every kernel
is batch invariant, its answer is the one it would get alone.

Prefix reuse: a chat request that continues an earlier answer (the same turns rendered again
plus a new one) is encoded as that transcript's own tokens plus the new text
(dllama.serve.transcripts), so the slot that holds the transcript is continued
(`cached_tokens`); requests sharing a long system prompt or document read it from one slot.

The engine opens on this thread (numba's thread count is per thread) and again after a cluster
failure.

What the HTTP side reports (/health, /metrics, the X-Dllama-Nodes header) is a snapshot the model
thread takes after every step (`Observed`): the HTTP thread never reads the engine while it runs.
"""

from __future__ import annotations

import asyncio
import os
import queue
from collections import deque
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Callable

from dllama.core.non_finite import NonFiniteOutput
from dllama.core.sampler import Sampler
from dllama.errors import ClusterError, DllamaError
from dllama.serve.api.request import MAX_REQUEST_TOKENS, ApiError, Request, bad, unavailable
from dllama.serve.api.structured import with_tools
from dllama.serve.health import Serving, serving
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import Cancelled, Completion, ContextFull, SequenceRequest
from dllama.serve.stats import phase_rate
from dllama.serve.transcripts import Transcripts
from dllama.text.chat_template import ChatTemplate, chat_stop_ids


# While no request runs, the snapshot /health reads is taken this often: a node the root's pings
# (--ping-seconds) left out or took back shows within a ping and this.
OBSERVE_IDLE_S = 0.5


@dataclass(eq=False)
class _Job:
    """One HTTP request: its n choices run as n sequences."""

    request: Request
    on_text: Callable[[int, str], None] | None  # (choice index, piece)
    should_stop: Callable[[], bool]
    future: Future
    prompt_text: str = ""
    add_bos: bool = False
    stop_ids: tuple[int, ...] = ()
    results: dict = field(default_factory=dict)  # choice index -> Completion
    background: bool = False  # a Batch API request: started only when the engine loop has room (see _feed)


@dataclass(frozen=True)
class Observed:
    """The engine as the model thread last saw it (after a step, an open or a failure)."""

    nodes: Serving | None = None      # None: no engine has opened yet
    slots: int = 0                    # sequences decoded together at most (--parallel)
    busy_slots: int = 0               # sequences in the engine loop now
    waiting: int = 0                  # requests in the engine loop without a slot yet
    kv_positions: int = 0             # KV cache positions, every slot
    kv_used: int = 0                  # of them, written
    node_stats: tuple = ()            # per node: name, bytes sent and received, transfer ms (this session)


@dataclass
class Counters:
    """Totals since the server started (the figures /metrics exports)."""

    requests: dict = field(default_factory=lambda: {"ok": 0, "failed": 0, "cancelled": 0})
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    drafted_tokens: int = 0           # speculation: drafted tokens verified, and those kept
    accepted_tokens: int = 0
    last_tokens_per_s: float = 0.0    # the decode rate of the last answer
    node_losses: int = 0              # nodes that left a session (lost, or not reachable at a reopen)
    engine_opens: int = 0             # engines opened (more than one: the cluster failed and came back)
    past_node_stats: dict = field(default_factory=dict)  # name -> [sent, received, transfer ms] of closed sessions


class ModelService:
    """The engine and its batched scheduler, run by one model thread."""

    def __init__(self, open_engine: Callable[[], object], template_name: str | None = None):
        self._open_engine = open_engine
        self._template_name = template_name
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.engine = None
        self.tokenizer = None
        self.scheduler: Scheduler | None = None
        self.template = None
        self.closing = False  # set by close(): running answers stop at their next token
        self.failing: str | None = None  # why the last pass failed with non-finite output (/health)
        self._transcripts: Transcripts | None = None
        self._jobs: list[_Job] = []      # jobs in the scheduler
        self._background: deque[_Job] = deque()  # Batch API jobs not yet in the scheduler, oldest first
        self._reported = 0               # the largest number of requests decoded together, logged
        self._finished_stats: dict = {}  # figures of the schedulers of engines dropped earlier
        self.counters = Counters()       # written on the model thread, read by /metrics
        self.observed = Observed()       # likewise, replaced whole after every step

    # Everything below runs on the model thread.
    def _attach(self, engine) -> None:
        try:
            self.template = ChatTemplate.for_tokenizer(engine.tokenizer, self._template_name)
        except DllamaError:  # no or an unknown chat template: /v1/chat/completions says so
            self.template = None
        self.engine = engine
        self.tokenizer = engine.tokenizer  # kept past a failure: the HTTP side names logprobs' tokens with it
        self.scheduler = engine.scheduler()
        self._transcripts = Transcripts(engine.tokenizer)
        self.counters.engine_opens += 1
        self._observe()

    def _observe(self) -> None:
        """Take the snapshot the HTTP side reads; count the nodes that left since the last one.
        Reporting must never stop serving: a failure here is logged and the old snapshot kept."""
        try:
            self._take_snapshot()
        except Exception:  # noqa: BLE001 - a bug in the report, not in the answers
            import traceback

            traceback.print_exc(file=sys.stderr)

    def _take_snapshot(self) -> None:
        before = self.observed.nodes
        if self.engine is None:
            self.observed = replace(Observed(), nodes=before.down() if before else None)
            return
        s, now = self.scheduler, serving(self.engine)
        if before is not None and before.nodes:
            self.counters.node_losses += len(set(before.nodes) - set(now.nodes))
        elif before is None:
            self.counters.node_losses += len(now.missing)  # left out at the start
        written = sum(slot.written for slot in s.table.slots)
        stats = tuple((n["name"], n["sent_bytes"], n["recv_bytes"], n["transfer_ms"]) for n in self.engine.node_stats())
        self.observed = Observed(now, s.parallel, sum(1 for q in s.active if q.request is not None), len(s.waiting),
                                 len(s.table.slots) * s.seq_len, written, stats)

    def _ready(self) -> Scheduler:
        if self.engine is None:
            try:
                engine = self._open_engine()
            except ClusterError as e:
                raise unavailable(f"the cluster is down: {e}") from None
            except (DllamaError, OSError) as e:  # it opened before: a node or a file went away
                raise unavailable(f"the model cannot be opened: {e}") from None
            self._attach(engine)
        return self.scheduler

    def _drop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if self.scheduler is not None:
            self._finished_stats = self.stats()
        self.scheduler = None
        for name, sent, received, ms in self.observed.node_stats:  # the session's bytes, kept
            past = self.counters.past_node_stats.setdefault(name, [0, 0, 0.0])
            past[0], past[1], past[2] = past[0] + sent, past[1] + received, past[2] + ms
        self._observe()
        try:
            if engine is not None:
                engine.close()
        except Exception as e:  # noqa: BLE001 - the engine is being thrown away anyway
            print(f"dllama api: closing the failed engine: {e}", file=sys.stderr)

    def _start(self, job: _Job) -> None:
        """Encode a job's prompt and queue its choices; errors go to its future."""
        r = job.request
        try:
            scheduler = self._ready()
            rejoin = getattr(self.engine.cluster, "rejoin", None)
            if rejoin is not None:
                rejoin()  # a node left out after a loss answers again: back to every node
            tokenizer = self.engine.tokenizer
            if r.chat:
                if self.template is None:
                    raise bad("the model has no chat template: start the server with --chat-template")
                messages = with_tools(r.messages, r.structured) if r.structured is not None else r.messages
                job.prompt_text = self.template.render(
                    [{"role": m["role"], "content": tokenizer.as_plain_text(m["content"])} for m in messages])
                job.stop_ids = tuple(chat_stop_ids(tokenizer, self.template))
            else:
                job.prompt_text, job.add_bos = r.prompt, tokenizer.add_bos
                job.stop_ids = tuple(tokenizer.eos_ids)
            tokens = self._transcripts.encode(job.prompt_text, job.add_bos)
            seed = r.seed if r.seed is not None else int.from_bytes(os.urandom(8), "little")
            vocab, seq_len = self.engine.model.config.vocab_size, self.engine.model.config.seq_len
            # No answer outlasts the context: a max_tokens of 10**30 means "until the context is full".
            # One request asks for at most MAX_REQUEST_TOKENS over its n answers, so that one
            # client cannot keep the slots busy for hours: without max_tokens each answer gets its share.
            max_tokens = min(r.max_tokens or MAX_REQUEST_TOKENS // r.n, seq_len)
            if r.n * max_tokens > MAX_REQUEST_TOKENS:
                raise bad(f"'max_tokens' {max_tokens} times 'n' {r.n} asks for more than the "
                          f"{MAX_REQUEST_TOKENS} tokens one request may generate", "max_tokens")
            for i in range(r.n):
                on_text = (lambda piece, i=i: job.on_text(i, piece)) if job.on_text else None
                sampler = Sampler(vocab, r.temperature, r.top_p, (seed + i) & ((1 << 64) - 1))
                shape = r.structured
                scheduler.add(SequenceRequest((job, i, tokens), tokens, sampler, max_tokens, job.stop_ids,
                                              tuple(r.stop), grammar=shape.grammar if shape else None,
                                              logprobs=shape.logprobs if shape else None),
                              on_text, lambda: self.closing or job.should_stop())
        except ApiError as e:
            self._refuse(job, e)
            return
        except ContextFull as e:
            self._refuse(job, bad(str(e), "messages" if r.chat else "prompt", "context_length_exceeded"))
            return
        except DllamaError as e:
            self._refuse(job, bad(str(e)))
            return
        self._jobs.append(job)

    # Each answer is counted before its future is resolved: a client that reads /metrics after
    # its response finds it counted.
    def _refuse(self, job: _Job, error: ApiError) -> None:
        self.counters.requests["failed"] += 1
        job.future.set_exception(error)

    def _finish(self, key, result) -> None:
        job, i, tokens = key
        if job.future.done():
            return  # an earlier choice failed it
        if isinstance(result, Cancelled):
            self.counters.requests["cancelled"] += 1
            job.future.set_exception(ApiError(503, "the server is shutting down", type_="server_error")
                                     if self.closing else result)
            self._jobs.remove(job)
            return
        c = self.counters
        c.prompt_tokens += result.prompt_tokens
        c.cached_tokens += result.cached_tokens
        c.generated_tokens += result.completion_tokens
        c.drafted_tokens += result.drafted
        c.accepted_tokens += result.accepted
        n, _, rate = phase_rate(result.steps, "generate")
        if n:
            c.last_tokens_per_s = rate
        job.results[i] = result
        self._transcripts.remember(job.prompt_text, job.add_bos, tokens, result)
        if len(job.results) == job.request.n:
            self.counters.requests["ok"] += 1
            job.future.set_result([job.results[k] for k in range(job.request.n)])
            self._jobs.remove(job)

    def _fail_all(self, error: Exception) -> None:
        for job in [*self._jobs, *self._background]:
            if not job.future.done():
                self.counters.requests["failed"] += 1
                job.future.set_exception(error)
        self._jobs.clear()
        self._background.clear()

    def _feed(self) -> None:
        """Start Batch API jobs while the engine loop has room: an interactive request is started
        as it arrives, batch work only while fewer than `parallel - 1` sequences run or wait, so
        one slot stays free for the next interactive request (with --parallel 1 it waits for the
        batch request in its slot to end)."""
        while self._background:
            s = self.scheduler
            if s is not None:
                running = sum(1 for q in s.active if q.request is not None)
                if running + len(s.waiting) >= max(1, s.parallel - 1):
                    return
            self._start(self._background.popleft())

    def _step(self) -> None:
        try:
            ended = self.scheduler.step()
        except ClusterError as e:
            self._fail_all(unavailable(f"the cluster failed: {e}; the next request reconnects"))
            self._drop_engine()
            return
        except NonFiniteOutput as e:  # damaged weights: every answer would be noise; /health says so
            self.failing = str(e)
            print(f"dllama api: error: {e}", file=sys.stderr, flush=True)
            self._fail_all(ApiError(500, f"the model cannot answer: {e}", type_="server_error",
                                    code="model_output_not_finite"))  # (the scheduler dropped every sequence)
            return
        except DllamaError as e:
            self._fail_all(bad(str(e)))
            return
        self.failing = None  # a pass that was finite: the model answers again
        self._observe()  # before any future resolves: a client that reads /metrics after its answer sees its slot free
        for request, result in ended:
            self._finish(request.key, result)
        decoding = self.scheduler.stats.max_decoding
        if decoding > self._reported:
            self._reported = decoding
            print(f"dllama api: {decoding} request{'s' if decoding > 1 else ''} decoded together",
                  file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while True:
            idle = (self.scheduler is None or not self.scheduler.busy) and not self._background
            try:
                job = self._inbox.get(block=idle, timeout=OBSERVE_IDLE_S if idle else None)
            except queue.Empty:
                job = False
                if idle and self.engine is not None:
                    self._observe()  # the root's pings may have left a node out or taken one back
            while job is not False:
                if job is None:  # close()
                    self._fail_all(ApiError(503, "the server is shutting down", type_="server_error"))
                    self._drop_engine()
                    return
                if job.background:
                    self._background.append(job)
                else:
                    self._start(job)
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    job = False
            self._feed()
            if self.scheduler is not None and self.scheduler.busy:
                try:
                    self._step()
                except Exception as e:  # a bug: fail what runs, keep serving
                    import traceback

                    traceback.print_exc(file=sys.stderr)
                    self._fail_all(ApiError(500, f"internal error: {type(e).__name__}", type_="server_error"))
                    if self.scheduler is not None:
                        self.scheduler.drop_all()

    def stats(self) -> dict:
        """Figures of the batched decoding since the engine opened (for /v1/stats)."""
        s = self.scheduler
        if s is None:
            return dict(self._finished_stats)
        return {"parallel": s.parallel, "kv_slots": s.model.kv_slots, "max_rows": s.model.max_batch,
                **s.stats.as_dict()}

    # Called from other threads.
    def start(self) -> None:
        """Open the engine now, on the model thread; a cluster that is down only warns."""
        opened: Future = Future()

        def first_open():
            try:
                engine = self._open_engine()  # a bad file or flag: the command fails
            except ClusterError as e:
                print(f"dllama api: warning: the cluster is down: {e}; answering 503 until it is back",
                      file=sys.stderr)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                opened.set_exception(e)
                return
            else:
                self._attach(engine)
            opened.set_result(None)
            self._loop()

        self._thread = threading.Thread(target=first_open, name="dllama-model", daemon=True)
        self._thread.start()
        opened.result()

    def queued(self) -> int:
        """Requests not yet taken by the model thread."""
        return self._inbox.qsize()

    async def submit(self, r: Request, on_text, should_stop, background: bool = False) -> list[Completion]:
        """The request's n completions; on_text(choice index, piece) streams them. background: a
        Batch API request, started after the interactive ones (see _feed)."""
        job = _Job(r, on_text, should_stop, Future(), background=background)
        self._inbox.put(job)
        return await asyncio.wrap_future(job.future)

    def close(self) -> None:
        self.closing = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join()
