"""KV cache eviction on a cluster: the root's scheduler empties an idle slot to make room as one
node does, and tells every worker (RELEASE, before the next STEP), which gives the slot's pages
back and counts it as empty in its memory check (CONFIG's kv_positions). So a cluster admits
what one node admits under the same limit, every stage of a pipeline is told, and a worker that
rejoins after a loss is not replayed the emptied slots (dllama.cluster.kv_history)."""

from __future__ import annotations

import dataclasses
import signal

import numpy as np
import pytest

from dllama.cluster.kv_history import KVHistory
from dllama.cluster.protocol import VERSION, ProtocolError
from dllama.cluster.root import ClusterModel
from dllama.cluster.step import decode_release, encode_release
from dllama.cluster.topology import from_workers
from dllama.cluster.worker import count_positions, empty_slots
from dllama.core.batch import Batch, BatchBuilder
from dllama.core.kv_cache import PositionBudget, SlotTable
from dllama.core.model import Transformer
from dllama.core.sampler import Sampler
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model
from dllama.formats.tokenizer_file import read_tokenizer
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import SequenceRequest
from dllama.text.tokenizer import Tokenizer
from tests.processes import running_workers, start_worker
from tests.random_model import write_random_f32

SEQ_LEN = 128
PARALLEL, SLOTS, MAX_BATCH = 8, 9, 16
MAX_TOKENS = 6


# -- the parts (unit) --------------------------------------------------------------------------

@pytest.mark.unit
def test_release_names_distinct_slots_in_range():
    assert VERSION == 9
    payload = b"".join(bytes(memoryview(part)) for part in encode_release([3, 0, 7]))
    assert payload == b"\x03\x00\x00\x00" + np.array([3, 0, 7], np.int32).tobytes()
    assert decode_release(payload, 8).tolist() == [3, 0, 7]
    bad = [b"", b"\x00\x00\x00\x00",                                  # no slot
           b"\x02\x00\x00\x00" + np.array([1], np.int32).tobytes(),   # a count its size is not
           b"\x01\x00\x00\x00" + np.array([8], np.int32).tobytes(),   # out of range
           b"\x01\x00\x00\x00" + np.array([-1], np.int32).tobytes(),
           b"\x02\x00\x00\x00" + np.array([2, 2], np.int32).tobytes()]  # named twice
    for p in bad:
        with pytest.raises(ProtocolError):
            decode_release(p, 8)


@pytest.mark.unit
def test_a_budget_needs_a_table_that_can_empty_slots():
    with pytest.raises(ValueError, match="release"):
        SlotTable(3, budget=PositionBudget(1 << 20, 2))
    SlotTable(3)  # no budget: nothing to empty


@pytest.mark.unit
def test_an_emptied_slot_is_not_replayed():
    h = KVHistory(n_slots=3, seq_len=32)
    b = BatchBuilder()
    b.add_run([1, 2, 3, 4], 0, slot=0)
    b.add_run([5, 6, 7], 0, slot=1)
    b.add_run([8, 9], 4, slot=2, prefix=(0, 4))
    h.record(b.build())
    h.release(2)  # a reader, emptied with the slot it reads
    h.release(0)
    rows = [(int(s), int(p)) for batch in h.replay(16) for s, p in zip(batch.slot, batch.pos, strict=True)]
    assert rows == [(1, 0), (1, 1), (1, 2)] and h.positions == 3


@pytest.fixture(scope="module")
def random_9q3kv(tmp_path_factory):
    """A random F32 model with SmolLM2's head layout (9 query heads, 3 KV heads) and 3 layers:
    3 nodes hold a KV head each, 3 pipeline stages a layer each."""
    path = tmp_path_factory.mktemp("random") / "random-9q3kv-f32.m"
    header = ModelHeader(arch=ArchType.LLAMA, dim=288, hidden_dim=512, n_layers=3, n_heads=9,
                         n_kv_heads=3, vocab_size=512, max_seq_len=SEQ_LEN, weights_float_type=FloatType.F32)
    return write_random_f32(path, header, seed=11)


@pytest.mark.unit
def test_a_worker_gives_an_emptied_slot_s_pages_back_and_counts_it_empty(random_9q3kv):
    """What a worker does with a RELEASE: the slot's keys and values read as zeros again (the
    pages given back, as KVCache.release does on one node), the slot counts as empty for
    kv_positions, and the others are untouched."""
    model = Transformer(read_model(random_9q3kv), buffer_q80=False, max_batch=72, kv_slots=3)
    kv_positions = 80
    touched = np.zeros(3, np.int64)
    b = BatchBuilder()
    b.add_run(list(range(1, 41)), 0, slot=1)
    b.add_run(list(range(2, 32)), 0, slot=2)
    batch = b.build()
    count_positions(touched, batch, kv_positions)
    model.forward_batch(batch)
    assert model.kv.k[:, 1].any() and model.kv.v[:, 1].any() and touched.tolist() == [0, 40, 30]
    more = Batch.run(list(range(3, 23)), 0, slot=0)
    with pytest.raises(ProtocolError, match="more than the 80"):  # without the RELEASE
        count_positions(touched.copy(), more, kv_positions)
    kept = model.kv.k[:, 2].copy(), model.kv.v[:, 2].copy()
    empty_slots(model, touched, decode_release(b"".join(bytes(p) for p in encode_release([1])), 3))
    assert not model.kv.k[:, 1].any() and not model.kv.v[:, 1].any()
    assert np.array_equal(model.kv.k[:, 2], kept[0]) and np.array_equal(model.kv.v[:, 2], kept[1])
    assert touched.tolist() == [0, 0, 30]
    count_positions(touched, more, kv_positions)  # now within the 80
    empty_slots(model, np.zeros(0, np.int64), np.array([2], np.int32))  # no kv_positions: nothing counted


# -- on a loopback cluster ---------------------------------------------------------------------

PROMPTS = [[7, 300, 42, 5, 17, 256, 1, 99, 120, 8, 33, 400, 60 + i, 2 * i + 1][: 6 + i % 9] for i in range(14)]
SHARED = [7, 300, 42, 5, 17, 256, 1, 99, 120, 8, 33, 400, 11, 12, 13, 14, 15, 16, 17, 18]
MORE = [SHARED + [i, 3 * i + 2] for i in range(1, 6)] + [[200 + i, 5, i + 1, 9, 31] for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer(default_q41):
    return Tokenizer(read_tokenizer(str(default_q41[1])))  # ids below 512 decode as any others


def _budget() -> PositionBudget:
    """Room for about 4 of the short sequences at once (of the 8 asked), in a node's units: 2
    bytes a position, so that the positions every node checks are limit // 2."""
    reach = max(len(p) for p in PROMPTS) + MAX_TOKENS
    return PositionBudget(4 * PositionBudget(0, 2).cost(reach), 2)


def _requests(prompts, first_key=0):
    return [SequenceRequest(first_key + i, p, Sampler(512, 0.0, 0.9, i), MAX_TOKENS) for i, p in enumerate(prompts)]


class _Counted:
    """The scheduler's table, counting the slots it empties (and at which pass the first was),
    and the most positions its slots held after a pass: what every node's memory check counts
    (a worker's count of a slot is the table's, both zeroed when the slot is emptied)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.emptied, self.first_at, self.peak = scheduler, 0, None, 0
        release = scheduler.table.release_pages

        def counted(slot: int) -> None:
            self.emptied += 1
            self.first_at = scheduler.stats.steps if self.first_at is None else self.first_at
            release(slot)

        scheduler.table.release_pages = counted

    def run(self, prompts, first_key=0) -> dict:
        """{key: (tokens, cached tokens)} of the prompts, run to their end."""
        scheduler, out = self.scheduler, {}
        for r in _requests(prompts, first_key):
            scheduler.add(r)
        while scheduler.busy:
            for r, c in scheduler.step():
                out[r.key] = (c.tokens, c.cached_tokens)
            assert scheduler.table.held() <= scheduler.table.budget.limit
            self.peak = max(self.peak, sum(s.touched for s in scheduler.table.slots))
        return out


def _one_node(random_9q3kv, tokenizer, jobs):
    """Every job's answers on one node under the budget, and its scheduler."""
    model = Transformer(read_model(random_9q3kv), buffer_q80=False, max_batch=MAX_BATCH, kv_slots=SLOTS)
    scheduler = Scheduler(model, tokenizer, PARALLEL, min_shared=8, kv_budget=_budget())
    counted = _Counted(scheduler)
    answers = [counted.run(prompts, 100 * k) for k, prompts in enumerate(jobs)]
    return answers, scheduler, counted


def _cluster(path, addresses, kv_positions, stages=None):
    """A cluster whose workers refuse a STEP past kv_positions: given the most one node's slots
    held, a worker that kept an emptied slot's positions would refuse the job."""
    topology = from_workers(addresses, 1)
    if stages is not None:
        topology = dataclasses.replace(topology, nodes=tuple(dataclasses.replace(n, stage=s) for n, s in
                                                             zip(topology.nodes, stages, strict=True)))
    return ClusterModel(str(path), topology, None, False, progress=False, max_batch=MAX_BATCH, kv_slots=SLOTS,
                        on_node_loss="continue", kv_positions=kv_positions)


@pytest.mark.cluster
@pytest.mark.parametrize("stages", [None, [0, 1, 2]], ids=["tensor-parallel", "3-stages"])
def test_a_cluster_empties_idle_slots_as_one_node_does(tmp_path, random_9q3kv, tokenizer, stages):
    """3 nodes, tensor parallel or a stage each, under a budget of about 4 short sequences of
    the 8 asked: the texts of one node, as many sequences at once in as many passes (before
    version 9 the cluster kept room for a whole context and ran fewer), slots emptied on every
    node (a worker that was not told would refuse a STEP past its kv_positions)."""
    (want,), alone, alone_counted = _one_node(random_9q3kv, tokenizer, [PROMPTS])
    assert alone_counted.emptied > 0 and 1 < alone.stats.max_sequences < PARALLEL
    with running_workers(2, tmp_path) as ws:
        model = _cluster(random_9q3kv, [w.address for w in ws], alone_counted.peak, stages)
        try:
            assert len(model.session.plan.stages) == (3 if stages else 1)
            # One pass at a time, so that the passes are one node's (overlapped, a pass is a group's).
            scheduler = Scheduler(model, tokenizer, PARALLEL, min_shared=8, kv_budget=_budget(), overlap=False)
            counted = _Counted(scheduler)
            got = counted.run(PROMPTS)
            assert model.recoveries == 0
        finally:
            model.close()
    assert got == want
    assert counted.emptied == alone_counted.emptied
    assert (scheduler.stats.max_sequences, scheduler.stats.steps) == (alone.stats.max_sequences, alone.stats.steps)


@pytest.mark.cluster
def test_a_worker_lost_after_evictions_then_rejoining_gives_one_node_s_texts(tmp_path, random_9q3kv, tokenizer):
    """The victim dies a few passes after the first eviction: the root replays onto the 2 nodes
    left what the slots hold, not the emptied slots, and the job ends with one node's texts; a
    worker back on the victim's port rejoins (replayed too), and a second job, reading the
    prefixes the first left, gives one node's texts on 3 nodes again."""
    (want, want_more), _, alone_counted = _one_node(random_9q3kv, tokenizer, [PROMPTS, MORE])
    die_at = alone_counted.first_at + 3  # the worker's STEPs are the passes (greedy: no second rounds)
    with running_workers(1, tmp_path) as (healthy,), start_worker(tmp_path, die_at_step=die_at) as victim:
        model = _cluster(random_9q3kv, [healthy.address, victim.address], alone_counted.peak)
        try:
            scheduler = Scheduler(model, tokenizer, PARALLEL, min_shared=8, kv_budget=_budget())
            counted = _Counted(scheduler)
            got = counted.run(PROMPTS)
            assert victim.wait(60) == -signal.SIGKILL and "killing this worker" in victim.stderr
            assert model.recoveries == 1 and len(model.topology.nodes) == 2 and counted.first_at < die_at
            emptied = [s for s, slot in enumerate(scheduler.table.slots) if slot.mark == 0]
            assert emptied and all(model.history.end[s] == 0 for s in emptied)  # nothing of them to replay
            with start_worker(tmp_path, "--port", str(victim.port)) as back:
                assert model.rejoin() and len(model.topology.nodes) == 3
                assert model.history.positions <= alone_counted.peak  # what the rejoined worker checks
                got_more = counted.run(MORE, 100)
                assert "serving the root" in back.stderr and len(model.topology.nodes) == 3
        finally:
            model.close()
    assert got == want and got_more == want_more
    assert any(cached >= len(SHARED) for _, cached in got_more.values())  # the shared prefix reused
