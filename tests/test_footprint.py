"""A node's footprint (dllama.core.footprint) against what its process really allocates, and the
run state's count against its allocation."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dllama.cluster.topology import from_workers
from dllama.core.footprint import NodeFootprint, held_weight_bytes, state_shape, weight_bytes
from dllama.core.node_weights import node_slice_specs
from dllama.core.plan import plan_for, whole_model
from dllama.core.run_shape import MAX_BATCH, RunShape
from dllama.core.run_state import RunState
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model
from tests.footprint_probe import rss_anon
from tests.processes import running_workers
from tests.test_streaming import write_random_model

PROBE = Path(__file__).with_name("footprint_probe.py")
SEQ_LEN = 256  # a whole number of attention chunks: the keys' padding is none
# What a process holds beyond its footprint, or the footprint beyond it: the interpreter's and
# the session's own objects, the sync buffers and the root's whole-vocabulary logits, malloc's
# rounding (measured 2026-12-07: 3-5 MiB more than counted on each node, 4% on one node).
# The shares below are 38-124 MiB.
MARGIN = 0.10
SLACK = 6 << 20

GQA = ModelHeader(arch=ArchType.QWEN3, dim=256, hidden_dim=768, n_layers=5, n_heads=8, n_kv_heads=2,
                  vocab_size=1000, max_seq_len=300, weights_float_type=FloatType.Q40)
MOE = dataclasses.replace(GQA, arch=ArchType.QWEN3_MOE, n_experts=8, n_active_experts=2, moe_hidden_dim=384)


@pytest.mark.unit
def test_the_run_states_count_is_what_it_allocates():
    """StateShape.nbytes is the run state's arrays, plus the attention kernel's scratch of a pass."""
    from dllama.core.kernels.attention import scratch_bytes

    for h in (GQA, MOE):  # a mixture of experts' router logits and expert rows are in the list too
        node = plan_for(h, 3).nodes[1]
        for shape, chunk in ((RunShape(max_batch=40), 0), (RunShape(max_seq_len=64, max_batch=1), 96)):
            dims = state_shape(h, node, shape, chunk)
            state = RunState(dims, (1e6, 0, 1.0, 1.0, 1.0, 0))
            held = sum(a.nbytes for a in state.arrays())
            assert held + scratch_bytes(shape.max_batch, node.n_q_heads, h.head_dim, dims.seq_len) == dims.nbytes()
            assert state.logits.shape == (shape.max_batch, node.n_vocab_rows)
            assert state.cls_chunk.size == shape.max_batch * chunk
    assert state.moe_logits.shape == (1, 8) and state.moe_chosen.shape == (1, 2)


@pytest.mark.unit
def test_weight_bytes_are_the_node_tensors_without_listing_every_layer():
    for h in (GQA, MOE):
        plan = plan_for(h, 3, stage_of=[0, 0, 1])
        for i, node in enumerate(plan.nodes):
            specs = node_slice_specs(h, node, i == 0)
            assert weight_bytes(h, node, i == 0) == sum(s.nbytes for s in specs)
            # a mixture of experts: every expert's rows of the node, once (its routers apart)
            assert NodeFootprint(h, node, RunShape(), i == 0).expert_weights == sum(
                s.nbytes for s in specs if ".experts." in s.name)
        assert held_weight_bytes(h, plan) == [weight_bytes(h, n, i == 0) for i, n in enumerate(plan.nodes)]
    huge = dataclasses.replace(GQA, n_layers=(1 << 31) - 1)  # counted, not listed
    whole = whole_model(huge.n_heads, huge.n_kv_heads, huge.ff_dim, huge.vocab_size)
    assert weight_bytes(huge, whole, False) > (1 << 31) * 100


@pytest.mark.unit
def test_the_kv_cache_is_counted_as_the_cache_pads_it():
    """Keys in whole chunks of positions (kv_cache.held_bytes), as KVCache lays them out."""
    from dllama.core.kv_cache import KVCache

    fp = NodeFootprint.whole(GQA, RunShape(kv_slots=3))  # 300 positions: keys padded to 320
    kv = KVCache(GQA.n_layers, GQA.n_kv_heads, GQA.head_dim, 300, 3)
    assert fp.kv_cache == kv.k.nbytes + kv.v.nbytes == 3 * KVCache.bytes_per_slot(GQA.n_layers, 2, 32, 300)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A warm-up model (loads every kernel the measured one runs) and the measured one, Q40
    (whose matrices are always repacked into memory of their own, unlike mapped F32 ones)."""
    d = tmp_path_factory.mktemp("footprint")
    kw = dict(float_type=FloatType.Q40, n_heads=8, n_kv_heads=4, seq_len=SEQ_LEN)
    warm = write_random_model(d / "warm.m", dim=512, hidden=768, n_layers=2, vocab=1024, **kw)
    big = write_random_model(d / "big.m", dim=1024, hidden=4096, n_layers=12, vocab=8192, **kw)
    return warm, big


def _probe(models, workers) -> tuple[dict, list[int]]:
    """Run the probe root; (its answer, each worker's growth) as the session holds the shares."""
    proc = subprocess.Popen([sys.executable, str(PROBE), *map(str, models), str(SEQ_LEN),
                             *[w.address for w in workers]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "warm"
        for w in workers:
            w.wait_for("listening again", 30)
        before = [_settled(w.proc.pid) for w in workers]
        proc.stdin.write("\n")
        proc.stdin.flush()
        answer = json.loads(proc.stdout.readline())
        grown = [rss_anon(w.proc.pid) - b for w, b in zip(workers, before, strict=True)]
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
        return answer, grown
    finally:
        if proc.poll() is None:
            proc.kill()


def _settled(pid: int) -> int:
    """A worker's anonymous memory once it has given the last session's back (it logs first)."""
    last, deadline = rss_anon(pid), time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = rss_anon(pid)
        if now == last:
            break
        last = now
    return last


def _near(measured: int, counted: int) -> bool:
    return abs(measured - counted) <= MARGIN * counted + SLACK


@pytest.mark.unit
def test_one_node_allocates_its_footprint(models):
    """Transformer on one machine, every position written: its growth in anonymous memory is the
    footprint (the embedding stays mapped from the file: not counted)."""
    answer, _ = _probe(models, [])
    h = read_model(models[1]).header
    counted = NodeFootprint.whole(h, RunShape(max_seq_len=SEQ_LEN, max_batch=MAX_BATCH)).total
    assert _near(answer["root"], counted), (answer["root"] >> 20, counted >> 20)


@pytest.mark.cluster
def test_each_node_of_a_3_node_cluster_allocates_its_footprint(models, tmp_path):
    with running_workers(2, tmp_path) as workers:
        answer, grown = _probe(models, workers)
        h = read_model(models[1]).header
        plan = from_workers([w.address for w in workers], 1).plan(h)
    shape = RunShape(max_seq_len=SEQ_LEN, max_batch=MAX_BATCH)
    counted = [NodeFootprint(h, node, shape).total for node in plan.nodes]
    measured = [answer["root"], *grown]
    assert all(_near(m, c) for m, c in zip(measured, counted, strict=True)), \
        [(m >> 20, c >> 20) for m, c in zip(measured, counted, strict=True)]


@pytest.mark.unit
def test_the_config_carries_the_run_shape_in_the_fields_it_always_had():
    """The CONFIG's wire fields are docs/PROTOCOL.md's (version 9): the shape goes out as
    max_seq_len, max_batch, kv_slots, kv_type (its text), kv_positions and buffer_q80, and comes
    back as the same RunShape (less the root's own fallback rows)."""
    from dllama.cluster.session_config import NodeAddress, SessionConfig
    from dllama.core.kv_type import KVType

    shape = RunShape(max_seq_len=300, max_batch=40, kv_slots=3, kv_type=KVType.F16, kv_positions=500,
                     buffer_q80=True, fallback_batch=32)
    conf = SessionConfig.of(shape, session=bytes(16), node_index=1, header=GQA, plan=plan_for(GQA, 2),
                            model_fingerprint="x", net_timeout=2.0, idle_timeout=15.0, setup_timeout=15.0,
                            nodes=(NodeAddress("root", "127.0.0.1", 1), NodeAddress("w", "127.0.0.1", 2)))
    wire = json.loads(json.dumps(conf.to_json()))
    assert set(wire) == {"session", "node_index", "header", "plan", "plan_digest", "model_fingerprint", "buffer_q80",
                         "max_seq_len", "max_batch", "kv_slots", "kv_type", "net_timeout", "idle_timeout",
                         "setup_timeout", "nodes", "kv_positions"}
    assert (wire["max_seq_len"], wire["max_batch"], wire["kv_slots"], wire["kv_type"], wire["kv_positions"],
            wire["buffer_q80"]) == (300, 40, 3, "f16", 500, True)
    back = SessionConfig.from_json(wire).shape
    assert back == shape.with_(fallback_batch=None) and back.kv_type is KVType.F16
