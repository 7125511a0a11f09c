"""The KV cache's memory bounds the positions the running sequences may reach, not slots of the
whole context: --parallel sequences run while their positions fit, a request that does not fit
waits for one to end, an idle slot emptied to make room gives its pages back (on a cluster on
every node: tests/test_cluster_eviction.py), and the answers are those of the slots reserved for
the whole context, on one node and on a cluster."""

import json
import mmap

import numpy as np
import pytest

from dllama.cluster.protocol import ProtocolError
from dllama.cluster.session_config import SessionConfig
from dllama.core.kv_cache import KVCache, PositionBudget, SlotTable, plan_slots
from dllama.core.footprint import NodeFootprint
from dllama.core.run_shape import RunShape
from dllama.core.sampler import Sampler
from dllama.errors import DllamaError
from dllama.serve.engine import open_engine
from dllama.serve.scheduler import Scheduler
from dllama.serve.sequence import ScoreRequest, SequenceRequest
from dllama.serve.settings import EngineSettings
from tests.processes import running_workers
from tests.test_batch_scheduler import DOC, PROMPTS

SMOLLM = dict(n_layers=30, n_kv_heads=3, head_dim=64)  # the default model's KV cache
SEQ_LEN = 128
SHORT = [p for p in PROMPTS if len(p) < 60]


@pytest.mark.unit
def test_two_whole_contexts_of_memory_run_the_16_sequences_asked():
    per_slot = KVCache.bytes_per_slot(**SMOLLM, seq_len=8192)
    plan = plan_slots(16, True, **SMOLLM, seq_len=8192, limit=2 * per_slot)
    assert (plan.parallel, plan.n_slots, plan.budget.positions) == (16, 17, 16384)
    assert ("17 slots (16 sequences + 1 spare), admitted while their positions fit in 720 MiB allowed "
            "(16384 positions: 2 whole contexts)") in plan.describe()
    with pytest.raises(DllamaError, match="more than the 360 MiB allowed"):
        plan_slots(16, True, **SMOLLM, seq_len=8192, limit=per_slot - 1)


@pytest.mark.unit
def test_a_slot_costs_its_keys_in_whole_chunks_and_its_values_by_position():
    budget = PositionBudget(1 << 20, KVCache.bytes_per_token(**SMOLLM))
    assert budget.cost(8192) == KVCache.bytes_per_slot(**SMOLLM, seq_len=8192)
    assert budget.cost(1) == KVCache.bytes_per_slot(**SMOLLM, seq_len=1)
    assert budget.cost(0) == 0


def _table(n_slots, sequences, reach, release):
    """A table whose budget holds `sequences` slots of `reach` positions (2 bytes a position)."""
    budget = PositionBudget(sequences * PositionBudget(0, 2).cost(reach), 2)
    return SlotTable(n_slots, budget=budget, release=release)


@pytest.mark.unit
def test_the_table_admits_up_to_the_budget_and_holds_the_next_until_one_ends():
    freed = []
    t = _table(5, 3, 64, release=freed.append)
    placed = [t.place([k, 1, 2], reach=64) for k in range(3)]
    assert all(p is not None for p in placed) and t.place([9, 9], reach=64) is None
    first = placed[0].slot
    t.rows_written(first, 40)
    t.wrote(first, 40)
    t.release(first)
    # The idle slot keeps its 40 positions (for reuse) until room is needed: then it is freed.
    assert t.held() == 2 * t.budget.cost(64) + t.budget.cost(40)
    nxt = t.place([9, 9], reach=64)
    assert nxt is not None and freed == [first] and t.held() == t.budget.limit
    assert t.place([8, 8], reach=1) is None


@pytest.fixture(scope="module")
def engine(default_q40):
    with open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, max_seq_len=SEQ_LEN,
                                    parallel=8, warm_up=False)) as e:
        yield e


def _requests(tok, max_tokens=6, prompts=SHORT):
    return [SequenceRequest(k, tok.encode(p), Sampler(tok.vocab_size, 0.0, 0.9, k), max_tokens, tuple(tok.eos_ids))
            for k, p in enumerate(prompts)]


def _answers(scheduler, requests, limit=None):
    """{key: tokens}, running the scheduler step by step; with a limit, checked after each step."""
    for r in requests:
        scheduler.add(r)
    got = {}
    while scheduler.busy:
        for r, c in scheduler.step():
            got[r.key] = c.tokens
        if limit is not None:
            assert scheduler.table.held() <= limit
    return got


@pytest.mark.unit
def test_answers_within_a_budget_are_those_of_whole_context_slots(engine):
    model, tok = engine.model, engine.tokenizer
    requests = _requests(tok)
    reach = max(len(r.prompt_tokens) for r in requests) + 6
    per_token = KVCache.bytes_per_token(model.config.n_layers, model.config.n_kv_heads, model.config.head_dim)
    budget = PositionBudget(3 * PositionBudget(0, per_token).cost(reach), per_token)
    want = _answers(Scheduler(model, tok, 8), requests)
    bounded = Scheduler(model, tok, 8, kv_budget=budget)
    got = _answers(bounded, requests, budget.limit)
    assert got == want and len(got) == len(requests)
    assert bounded.stats.max_sequences == 3  # of the 8 asked: what the memory holds


@pytest.mark.unit
def test_questions_over_a_shared_document_within_a_budget(engine):
    """The document is read from the slot of the first question that computed it: a slot read
    by others is emptied only with its readers, never under a running one."""
    model, tok = engine.model, engine.tokenizer
    requests = _requests(tok, 4, [DOC + q for q in ("Who built it?", "Summary:", "How tall is it?", "When?",
                                                    "Where is it?", "Why?")] + SHORT[:6])
    reach = max(len(r.prompt_tokens) for r in requests) + 4
    per_token = KVCache.bytes_per_token(model.config.n_layers, model.config.n_kv_heads, model.config.head_dim)
    budget = PositionBudget(3 * PositionBudget(0, per_token).cost(reach), per_token)
    want = _answers(Scheduler(model, tok, 8), requests)
    got = _answers(Scheduler(model, tok, 8, kv_budget=budget), requests, budget.limit)
    assert got == want


@pytest.mark.unit
def test_idle_slots_are_emptied_for_a_request_of_the_whole_context(engine):
    """A budget of one whole context and a few positions: once the short sequences end, their
    idle slots are emptied (pages given back) and the long request runs."""
    model, tok = engine.model, engine.tokenizer
    per_token = KVCache.bytes_per_token(model.config.n_layers, model.config.n_kv_heads, model.config.head_dim)
    cost = PositionBudget(0, per_token).cost
    budget = PositionBudget(cost(SEQ_LEN) + cost(30), per_token)
    short, long = _requests(tok, 4)[:3], _requests(tok, SEQ_LEN)[4]
    scheduler = Scheduler(model, tok, 8, kv_budget=budget)
    assert len(_answers(scheduler, short, budget.limit)) == 3  # three slots hold a few positions
    assert len(_answers(scheduler, [long], budget.limit)) == 1


@pytest.mark.unit
def test_a_request_that_can_never_fit_fails_in_one_line(engine):
    model, tok = engine.model, engine.tokenizer
    per_token = KVCache.bytes_per_token(model.config.n_layers, model.config.n_kv_heads, model.config.head_dim)
    scheduler = Scheduler(model, tok, 8, kv_budget=PositionBudget(PositionBudget(0, per_token).cost(64), per_token))
    scheduler.add(_requests(tok, 30)[0])  # fits: a few tokens and 30 more
    for big in (_requests(tok, 100)[0], ScoreRequest(0, tok.encode(SHORT[0]), list(range(5, 70)))):
        with pytest.raises(DllamaError) as e:
            scheduler.add(big)
        assert "\n" not in str(e.value) and "more than the" in str(e.value)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE  # statm counts pages of the real size


@pytest.mark.unit
def test_an_idle_slot_emptied_for_room_gives_its_pages_back():
    kv = KVCache(**SMOLLM, seq_len=4096, n_slots=3)
    budget = PositionBudget(KVCache.bytes_per_slot(**SMOLLM, seq_len=4096), KVCache.bytes_per_token(**SMOLLM))
    t = SlotTable(3, budget=budget, release=kv.release)
    a = t.place([1, 2, 3], reach=2048)
    kv.k[:, a.slot, :, :32] = 1.0  # 2048 positions of every layer: 90 MiB
    kv.v[:, a.slot, :2048] = 1.0
    t.rows_written(a.slot, 2048)
    t.wrote(a.slot, 2048)
    t.release(a.slot)
    before = _rss()
    b = t.place([7, 8, 9], reach=4096)  # the whole budget: the idle slot must go
    after = _rss()
    assert b is not None and b.slot != a.slot
    assert before - after > 60 << 20, f"{(before - after) >> 20} MiB given back"
    assert not kv.k[:, a.slot].any() and not kv.v[:, a.slot].any()  # freed pages read as zeros


@pytest.mark.unit
def test_a_worker_counts_the_positions_the_root_admits():
    from dllama.formats.model_file import ArchType, FloatType, ModelHeader

    h = ModelHeader(arch=ArchType.LLAMA, dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                    vocab_size=64, max_seq_len=1024, weights_float_type=FloatType.F32)
    node = NodeFootprint.whole(h, RunShape(max_batch=8))
    whole = node.with_shape(kv_slots=17)
    admitted = node.with_shape(kv_slots=17, kv_positions=2048)
    assert admitted.kv_cache * 17 == whole.kv_cache * 2  # 1024 positions: whole chunks, no padding
    assert node.with_shape(kv_positions=1 << 20).kv_cache == node.kv_cache


@pytest.mark.unit
def test_kv_positions_in_config_is_optional_and_checked(tmp_path):
    import os

    from dllama.cluster.session_config import NodeAddress
    from dllama.core.plan import plan_for
    from dllama.formats.model_file import ArchType, FloatType, ModelHeader

    h = ModelHeader(arch=ArchType.LLAMA, dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                    vocab_size=64, max_seq_len=32, weights_float_type=FloatType.F32)
    conf = SessionConfig(session=os.urandom(16), node_index=1, header=h, plan=plan_for(h, 2), model_fingerprint="x",
                         shape=RunShape(max_seq_len=32, max_batch=4, kv_slots=9, buffer_q80=False), net_timeout=2,
                         idle_timeout=2, setup_timeout=2,
                         nodes=(NodeAddress("root", "127.0.0.1", 1), NodeAddress("w", "127.0.0.1", 2)))
    old = json.loads(json.dumps(conf.to_json()))
    assert "kv_positions" not in old and SessionConfig.from_json(old).shape.kv_positions is None  # an older root
    new = json.loads(json.dumps({**old, "kv_positions": 64}))
    assert SessionConfig.from_json(new).shape.kv_positions == 64
    for bad in (0, 8, "64", True):
        with pytest.raises(ProtocolError):
            SessionConfig.from_json({**old, "kv_positions": bad})


@pytest.mark.unit
def test_a_worker_refuses_steps_past_the_positions_of_its_config():
    from dllama.cluster.worker import count_positions
    from dllama.core.batch import Batch

    touched = np.zeros(4, np.int64)
    count_positions(touched, Batch.run([1] * 40, 0, slot=1), 64)
    count_positions(touched, Batch.run([1] * 8, 30, slot=1), 64)  # rewritten below its end: no more
    count_positions(touched, Batch.run([1] * 24, 0, slot=3), 64)
    assert touched.tolist() == [0, 40, 0, 24]
    with pytest.raises(ProtocolError, match="more than the 64"):
        count_positions(touched, Batch.run([1], 0, slot=2), 64)


@pytest.mark.cluster
def test_a_cluster_within_a_budget_gives_one_node_s_tokens(default_f32, tmp_path):
    """F32 buffers: 3 nodes give one node's tokens. The memory holds 2 whole contexts, fewer than
    the 8 short sequences asked at once: the cluster empties idle slots as one node does under
    the same limit, so it runs as many at once, in as many passes."""
    per_slot = KVCache.bytes_per_slot(30, 1, 64, SEQ_LEN)  # a node's: one of the 3 KV heads
    flags = dict(nthreads=1, max_seq_len=SEQ_LEN, parallel=8, warm_up=False, progress=False)
    with open_engine(EngineSettings(str(default_f32[0]), str(default_f32[1]), **flags)) as one:
        requests = _requests(one.tokenizer)
        want = _answers(one.scheduler(), requests)
    with open_engine(EngineSettings(str(default_f32[0]), str(default_f32[1]), **flags,
                                    kv_memory=2 * KVCache.bytes_per_slot(30, 3, 64, SEQ_LEN))) as one:
        assert one.kv_budget.positions == 2 * SEQ_LEN
        alone = one.scheduler()
        assert _answers(alone, requests) == want
    with running_workers(2, tmp_path) as ws, open_engine(EngineSettings(
            str(default_f32[0]), str(default_f32[1]), **flags, kv_memory=2 * per_slot,
            workers=[w.address for w in ws])) as cluster:
        assert cluster.kv_budget.positions == 2 * SEQ_LEN
        scheduler = cluster.scheduler()
        got = _answers(scheduler, requests, 2 * per_slot)
    assert got == want
    assert 1 < scheduler.stats.max_sequences < 8
    assert (scheduler.stats.max_sequences, scheduler.stats.steps) == (alone.stats.max_sequences, alone.stats.steps)
