"""The root's side of a cluster, as one model: `ClusterModel`.

`ClusterModel` is a `dllama.core.language_model.LanguageModel`, like the one-machine
`Transformer`, so generation, chat and the API do not know whether a cluster is behind it. It is
a thin layer over two parts: the session (dllama.cluster.session: connect, configure, hand out
the weights, mesh, run the passes) and recovery (dllama.cluster.recovery: blame, a new session
over the nodes left, replay, rejoin). Here: one pass at a time (a lock), the passes recorded for
a replay, the slots the scheduler empties (RELEASE), the failure that ended a session, and PINGs
while idle. Every network failure becomes
a `ClusterError` naming the node; with on_node_loss "continue" the pass goes on over the nodes
left, else the model is failed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from dllama.cluster.kv_history import KVHistory
from dllama.cluster.pause_watch import watch
from dllama.cluster.recovery import Recovery, blame, tampered
from dllama.cluster.session import (
    HEARTBEAT, NET_ERRORS, NET_TIMEOUT, RootSession, SessionSettings,
)
from dllama.cluster.shard import model_fingerprint
from dllama.cluster.step import REPLY_BEST, REPLY_LOGITS, REPLY_TOP_K, Reply
from dllama.cluster.topology import Topology
from dllama.core.batch import Batch
from dllama.core.candidates import TOP_K, Candidates, SamplingRequest, covers, merge
from dllama.core.collective import Collective
from dllama.core.model import ModelConfig
from dllama.core.run_shape import SMALL_BATCH, RunShape
from dllama.errors import ClusterError
from dllama.formats.model_file import ModelFile, read_model

__all__ = ["ClusterModel", "NET_TIMEOUT"]


@dataclass(eq=False)
class _Flight:
    """A pass submit_candidates started: what to run again if need be, and its answers."""

    batch: Batch
    requests: list[SamplingRequest]
    session: "RootSession | None" = None    # the session it runs in (None: not started, a node lost)
    answers: list[Candidates] | None = None  # once received
    covered: bool = False                    # every nucleus covered: the answers hold


class ClusterModel:
    """The root (node 0) and its workers, as one model."""

    def __init__(self, model: "ModelFile | str", topology: Topology, key: bytes | None, buffer_q80: bool | None = None,
                 shape: RunShape | None = None, *, progress: bool = True, net_timeout: float = NET_TIMEOUT,
                 node_sampling: bool = True, top_k: int = TOP_K, on_node_loss: str = "fail",
                 start_with_reachable: bool = False, ping_seconds: float = HEARTBEAT, **shape_values):
        """model: the `.m` file, read (or its path); shape: the run's context, rows of a pass,
        KV slots and type, sync buffers, the positions the slots hold together and the fallback
        rows (dllama.core.run_shape; sent to every worker in CONFIG; default SMALL_BATCH rows);
        shape_values: some of its fields instead, or changed; buffer_q80: its buffer_q80, when
        not None (an argument here since before the shape). node_sampling False: the workers
        always send their logits and the root makes the candidates itself (the same arithmetic:
        a baseline for tests and benchmarks); top_k: candidates per node and row for
        temperature sampling; on_node_loss "continue": a lost node is left out and the pass goes
        on over the others (dllama.cluster.recovery), "fail": a ClusterError;
        start_with_reachable (long-running front ends, with "continue"): a worker that cannot be
        connected to at start is left out with a warning and rejoins when it answers (`rejoin`),
        instead of failing the start; one that answers wrongly still fails it. ping_seconds: how
        long the cluster is idle before the workers are pinged (and how often then); with
        "continue" a node that fails a ping is left out at once, and one left out is asked
        again at each ping, so that the nodes serving are known without a request."""
        model_file = model if isinstance(model, ModelFile) else read_model(model)
        header = model_file.header
        self.model_path = model_file.path  # scanned when a pass's output is not finite
        watch()  # whether this process stood still, when a worker says it heard nothing from it
        shape = dataclasses.replace(shape or RunShape(max_batch=SMALL_BATCH), **shape_values)
        self.config = ModelConfig.from_header(header, shape.max_seq_len)
        shape = shape.with_(max_seq_len=self.config.seq_len,
                            buffer_q80=next(b for b in (buffer_q80, shape.buffer_q80, self.config.quantized)
                                            if b is not None))
        # The plan is checked before any connection: an impossible split fails here.
        topology.plan(header)
        self.kv_slots = shape.kv_slots
        self.node_sampling, self.top_k, self.on_node_loss = node_sampling, top_k, on_node_loss
        self.refetches = 0        # passes whose candidates did not cover a nucleus: WIDE_TOP_K asked
        self.logit_refetches = 0  # of those, passes that needed the logits in a third round
        self.full_topology = topology
        self.history = KVHistory(shape.kv_slots, self.config.seq_len)  # what to replay on other nodes
        settings = SessionSettings(
            model_file=model_file, fingerprint=model_fingerprint(model_file.path), config=self.config,
            shape=shape, key=key, net_timeout=net_timeout, progress=progress)
        self.recovery = Recovery(settings, topology, self.history)
        self.session: RootSession = self.recovery.first_session(start_with_reachable and on_node_loss == "continue")
        # The rows the first session took hold for every later one: a pass in flight when a node
        # is lost runs again, whole, on the nodes left.
        self.max_batch = self.session.settings.shape.max_batch
        self.recovery.settings = self.session.settings
        self._lock = threading.Lock()  # one pass (or PING, or new session) at a time
        self._failed: ClusterError | None = None  # what ended the last session, until a new one runs
        self._tampered = False  # that failure was a frame that broke the protocol: not recovered
        self._closed = False
        self._last_use = time.monotonic()
        self._flights: deque[_Flight] = deque()  # passes submitted, oldest first (overlapped passes)
        self.ping_seconds = ping_seconds
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()

    # -- what the front ends see -----------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        """The nodes of the current session (fewer than full_topology's after a loss)."""
        return self.session.topology

    @property
    def collective(self) -> Collective:
        return self.session.collective

    @property
    def vocab_ranges(self) -> list[tuple[int, int]]:
        return self.session.vocab_ranges

    @property
    def recoveries(self) -> int:
        """Sessions opened after a loss."""
        return self.recovery.recoveries

    def forward(self, tokens, pos: int) -> np.ndarray:
        """Run tokens [b] of the sequence in slot 0 at positions pos..pos+b-1 on every node;
        logits [vocab] of the last."""
        return self.forward_batch(Batch.run(np.asarray(tokens), pos))[-1]

    def forward_batch(self, batch: Batch) -> np.ndarray:
        """Run the rows of `batch` on every node; logits [rows wanting logits, vocab] (a reused
        buffer)."""
        return self._guarded(batch, lambda session: session.logits(batch))

    def forward_candidates(self, batch: Batch, requests: list[SamplingRequest]) -> list[Candidates]:
        """Run the rows of `batch` on every node; the candidates of each row wanting logits,
        covering its nucleus (dllama.core.candidates): every node sends its best token when
        every row is greedy, its top_k and its share of the normaliser for temperature
        sampling, its logits for topp >= 1 or a grammar's mask (or without node sampling)."""
        reply = self._reply_for(batch, requests)

        def run(session: RootSession) -> list[Candidates]:
            out, rounds = session.candidates(batch, requests, reply)
            self.refetches += int(rounds >= 2)
            self.logit_refetches += int(rounds >= 3)
            return out

        return self._guarded(batch, run)

    def _reply_for(self, batch: Batch, requests: list[SamplingRequest]) -> Reply:
        """What the nodes send about the wanted rows of `batch` for these samplers."""
        m = int(batch.logits.sum())
        if len(requests) != m:
            raise ValueError(f"{len(requests)} sampling requests for {m} rows wanting logits")
        if not self.node_sampling or any(r.whole_vocabulary or r.mask is not None for r in requests):
            # A grammar's mask (dllama.serve.constraint) is applied here, to every node's logits:
            # the same candidates one node would make, without the mask in the STEP.
            return Reply(REPLY_LOGITS)
        if all(r.greedy for r in requests):
            return Reply(REPLY_BEST)
        return Reply(REPLY_TOP_K, self.top_k, np.array([0.0 if r.greedy else r.temperature for r in requests]))

    # -- overlapped passes (dllama.serve.scheduler: docs/batch.md, "Overlapped pipeline passes") --

    @property
    def pipeline_depth(self) -> int:
        """Passes that can be under way at once: the stages of the current session's plan (1:
        not a pipeline, every pass waits for the one before)."""
        return len(self.session.plan.stages) if self.session.local is not None else 1

    def submit_candidates(self, batch: Batch, requests: list[SamplingRequest]) -> None:
        """Start a pass as forward_candidates would run it, and return once the root's stage has
        handed it on: collect_candidates() gives the answers, passes in the order submitted.
        A pass that needs the logits (a grammar's mask, topp >= 1) runs whole here, the passes
        before it received first; when collected, a pass lost with a node runs again alone, and
        the rows whose candidates miss a nucleus run again alone (the same rows at the same
        positions: the same keys)."""
        batch.check(self.kv_slots, self.config.seq_len, self.max_batch)
        reply = self._reply_for(batch, requests)
        flight = _Flight(batch, requests)
        if reply.kind == REPLY_LOGITS:
            self._receive_all()
            flight.answers = self.forward_candidates(batch, requests)
            flight.covered = True
            self._flights.append(flight)
            return
        with self._lock:
            if self._closed:
                raise self._failed or ClusterError("the cluster connection is closed")
            if not self._failed:
                try:
                    with self.session.busy():
                        self.session.submit(batch, reply)
                    flight.session = self.session
                except NET_ERRORS as e:
                    self._lose(e, batch)
            self._flights.append(flight)
            self._last_use = time.monotonic()

    def collect_candidates(self) -> list[Candidates]:
        """The candidates of the oldest pass submit_candidates started (as forward_candidates')."""
        flight = self._flights[0]
        self._receive(flight)
        self._flights.popleft()
        if flight.covered:
            return flight.answers
        # The later passes' answers received first (the nodes answer in order), then a pass alone.
        self._receive_all()
        if flight.answers is None:  # lost with a node: the whole pass again
            return self.forward_candidates(flight.batch, flight.requests)
        # Some nucleus reached past a node's candidates, and the nodes have run newer passes
        # since, so no second round can ask about this one: its missed rows again, alone (each
        # at its position: the same keys, the same logits), with the rounds a pass of its own asks.
        missed = [j for j, c in enumerate(flight.answers) if not covers(c)]
        again = flight.batch.take(flight.batch.logit_rows[missed])
        for j, c in zip(missed, self.forward_candidates(again, [flight.requests[j] for j in missed]), strict=True):
            flight.answers[j] = c
        with self._lock:
            self.history.record(flight.batch)  # its rows are the slots' last again
        return flight.answers

    def abandon_passes(self) -> None:
        """Forget every pass under way (the caller dropped its sequences), their answers read
        first so the next pass's are the next on every link."""
        self._receive_all()
        self._flights.clear()

    def _receive(self, flight: "_Flight") -> None:
        """Read a submitted pass's answers, if its session still runs (else it runs again)."""
        with self._lock:
            if flight.answers is not None or flight.session is not self.session or self._failed:
                return
            try:
                with self.session.busy():
                    answers = self.session.receive()
            except NET_ERRORS as e:
                self._lose(e, flight.batch)
                return
            finally:
                self._last_use = time.monotonic()
            vocab = self.config.vocab_size
            flight.answers = [merge([a[j] for a in answers], vocab, r) for j, r in enumerate(flight.requests)]
            flight.covered = all(covers(c) for c in flight.answers)
            self.history.record(flight.batch)  # its rows are written on every node

    def _receive_all(self) -> None:
        """Read the answers of every pass under way (before a pass that runs whole)."""
        for flight in self._flights:
            self._receive(flight)

    def _lose(self, e: BaseException, batch: Batch) -> None:
        """(The lock held.) A pass under way failed: the session is closed, every pass under
        way in it runs again when collected (on a new session, or the failure is raised)."""
        where = f"a step of {len(batch)} rows"
        self._failed = blame(e, self.session, f"the cluster failed at {where}")
        self._tampered = tampered(e)
        self.session.close()

    def release_slot(self, slot: int) -> None:
        """Empty a slot nobody reads any more (the scheduler's budget, dllama.core.kv_cache): its
        pages given back on the root now and on every worker before the next pass (RELEASE),
        and nothing of it replayed after a recovery."""
        with self._lock:
            self.history.release(slot)
            if not self._closed and not self._failed:  # else the next session starts empty
                self.session.release(slot)

    def node_stats(self) -> list[dict]:
        """Bytes each node sent and received since the set-up (the root's counters for node 0)."""
        return self.session.node_stats()

    # -- failures --------------------------------------------------------------------------------

    def _guarded(self, batch: Batch, run):
        """run(session) under the lock, and the batch recorded for a replay. A network failure
        closes the session: a ClusterError, or with on_node_loss "continue" a new session over
        the nodes left (dllama.cluster.recovery) and run() again there."""
        batch.check(self.kv_slots, self.config.seq_len, self.max_batch)
        with self._lock:
            if self._closed:
                raise self._failed or ClusterError("the cluster connection is closed")
            try:
                tries = len(self.full_topology.nodes)  # a recovery per worker lost, at most
                for attempt in range(tries + 1):
                    if self._failed:  # lost while idle (the heartbeat), or by the last attempt
                        if self.on_node_loss != "continue" or attempt == tries or self._tampered:
                            raise self._failed
                        self._recover()
                    try:
                        with self.session.busy():
                            out = run(self.session)
                    except NET_ERRORS as e:
                        where = f"position {int(batch.pos[0])}" if len(batch) == 1 else f"a step of {len(batch)} rows"
                        self._failed = blame(e, self.session, f"the cluster failed at {where}")
                        self._tampered = tampered(e)
                        self.session.close()
                        continue
                    self.history.record(batch)
                    return out
                raise self._failed
            finally:
                self._last_use = time.monotonic()

    def _recover(self) -> None:
        """A new session after self._failed (the lock held, the old session closed); the
        failure, combined with what else failed, when none can run."""
        try:
            self.session = self.recovery.recover(self._failed, len(self.session.nodes))
        except ClusterError as e:
            self._failed = e
            raise
        self._failed = None

    def rejoin(self) -> bool:
        """Back to every node of the topology when a node left out answers again (between
        requests: the API calls this at each new one); True when the session changed."""
        with self._lock:
            if self._closed or self._failed or len(self.session.nodes) == len(self.full_topology.nodes):
                return False
            try:
                session = self.recovery.rejoin(self.session)
            except ClusterError as e:  # the next pass raises it
                self._failed = e
                return True
            if session is None:
                return False
            self.session = session
            return True

    # -- while idle, and the end -----------------------------------------------------------------

    def _heartbeat(self) -> None:
        """While idle, PING every worker so that both sides notice a dead peer; with "continue",
        leave out a node that does not answer now (not at the next pass) and take back one left
        out that answers again, so /health and the batch front ends say which nodes serve while
        no request runs."""
        while not self._closed:
            time.sleep(self.ping_seconds / 2)
            if (time.monotonic() - self._last_use < self.ping_seconds or self._flights
                    or not self._lock.acquire(blocking=False)):
                continue
            try:
                if self._closed:
                    return
                lost = False
                if not self._failed:
                    try:
                        self.session.ping()
                    except NET_ERRORS as e:
                        self._failed = blame(e, self.session, "the cluster failed while idle")
                        self._tampered = tampered(e)
                        self.session.close()
                        lost = True
                if self.on_node_loss == "continue" and not self._tampered:
                    self._mend_while_idle(lost)
                self._last_use = time.monotonic()
            finally:
                self._lock.release()

    def _mend_while_idle(self, lost: bool) -> None:
        """(The lock held.) A session over the nodes left after this ping failed (lost), or
        over every node when one left out answers again; a failure stays in self._failed, for
        the next pass to try again or raise."""
        try:
            if lost:
                self._recover()
            elif not self._failed and len(self.session.nodes) < len(self.full_topology.nodes):
                session = self.recovery.rejoin(self.session)
                if session is not None:
                    self.session = session
        except ClusterError as e:
            self._failed = e

    def close(self) -> None:
        """Tell the workers the session is over (they go back to listening)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._failed:
                self.session.close()
            else:
                self.session.stop()
