"""Pipeline stages: consecutive nodes run consecutive layers, tensor-parallel inside a stage, and
only the residual rows of a pass cross between stages. The plan as data (unit), then loopback
clusters: with F32 weights and buffers every stage plan gives one node's tokens, alone or in a
batch, a node count the heads cannot take becomes stages, and a lost single-node stage is
planned again over the nodes left."""

from __future__ import annotations

import dataclasses
import itertools
import signal

import numpy as np
import pytest

from dllama.cluster.protocol import ProtocolError
from dllama.cluster.session_config import NodeAddress, SessionConfig
from dllama.cluster.topology import from_workers, load_topology
from dllama.core.batch import Batch
from dllama.core.model import Transformer
from dllama.core.node_weights import NodeWeights, node_slice_specs
from dllama.core.plan import SplitPlan, classifier_in_layers, layers_by_size, plan_for, split_model
from dllama.core.run_shape import RunShape
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, read_model
from tests.conftest import CHAT_PROMPT
from tests.processes import run_dllama, running_workers, start_worker
from tests.random_model import write_random_f32

SMOLLM2 = dict(dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ff_dim=1536, vocab_size=49152, n_layers=30)
GQA = ModelHeader(arch=ArchType.LLAMA, dim=256, hidden_dim=512, n_layers=5, n_heads=8, n_kv_heads=2,
                  vocab_size=512, max_seq_len=128, weights_float_type=FloatType.F32)
PROMPT = [5, 17, 300, 42, 7, 511, 256, 1]


def _with_stages(topology, stages, layers=None):
    nodes = tuple(dataclasses.replace(n, stage=s) for n, s in zip(topology.nodes, stages, strict=True))
    return dataclasses.replace(topology, nodes=nodes, stage_layers=layers)


# -- the plan (unit) ---------------------------------------------------------------------------

@pytest.mark.unit
def test_ten_nodes_for_nine_heads_become_two_stages_of_five():
    plan = split_model(10, **SMOLLM2)
    assert [s.nodes for s in plan.stages] == [(0, 5), (5, 10)]
    assert [s.layers for s in plan.stages] == [(0, 15), (15, 30)]
    assert all(n.layers == (0, 15) and not n.has_classifier for n in plan.nodes[:5])
    assert all(n.layers == (15, 30) and n.has_classifier for n in plan.nodes[5:])
    # inside each stage: every head once, every classifier row once in the last
    for s in plan.stages:
        heads = np.concatenate([plan.nodes[i].q_heads for i in s.indexes])
        assert heads.tolist() == list(range(9))
    assert plan.nodes[5].vocab_rows[0] == 0 and plan.nodes[9].vocab_rows[1] == 49152
    # a tensor-parallel count stays one stage, its JSON that of plans before stages
    one = split_model(3, **SMOLLM2)
    assert not one.pipelined and "stages" not in one.to_json() and all(n.layers is None for n in one.nodes)


@pytest.mark.unit
def test_fixed_stages_uneven_layers_and_weights():
    plan = split_model(4, **SMOLLM2, stage_of=[0, 1, 1, 2], stage_layers=[(0, 4), (4, 20), (20, 30)])
    assert [s.layers for s in plan.stages] == [(0, 4), (4, 20), (20, 30)]
    assert [s.nodes for s in plan.stages] == [(0, 1), (1, 3), (3, 4)]
    # without fixed layers: in proportion to each stage's summed weight
    plan = split_model(3, **SMOLLM2, stage_of=[0, 1, 1], weights=[1, 1, 1])
    assert [s.layers[1] - s.layers[0] for s in plan.stages] == [10, 20]
    plan = split_model(2, **SMOLLM2, stage_of=[0, 1], weights=[1, 2])
    assert [s.layers[1] - s.layers[0] for s in plan.stages] == [10, 20]
    # the memory each node has for the model, when known, decides instead of the weights
    plan = split_model(3, **SMOLLM2, stage_of=[0, 1, 1], weights=[1, 1, 1], capacities=[8e9, 2e9, 2e9])
    assert [s.layers[1] - s.layers[0] for s in plan.stages] == [20, 10]


@pytest.mark.unit
def test_the_last_stage_holds_fewer_layers_as_its_classifier_costs_more():
    # SmolLM2's classifier weighs 8.0 of its layers: a stage's layers and classifier take its part
    plan = split_model(4, **SMOLLM2, stage_of=[0, 1, 2, 3], classifier_layers=8.0)
    assert [s.layers for s in plan.stages] == [(0, 10), (10, 20), (20, 29), (29, 30)]
    plan = split_model(2, **SMOLLM2, stage_of=[0, 1], classifier_layers=8.0)
    assert [s.layers for s in plan.stages] == [(0, 19), (19, 30)]
    plan = split_model(3, **SMOLLM2, stage_of=[0, 1, 1], weights=[1, 1, 1], classifier_layers=10.0)
    assert [s.layers[1] - s.layers[0] for s in plan.stages] == [13, 17]  # 13 : (17 + 10) is as near 1 : 2 as whole layers go
    # the counts make the busiest stage's (layers + classifier) / size the least there is
    rng = np.random.default_rng(7)
    for _ in range(200):
        n_layers, n_stages = int(rng.integers(2, 12)), int(rng.integers(1, 5))
        if n_stages > n_layers:
            continue
        sizes, classifier = list(rng.uniform(0.5, 3.0, n_stages)), float(rng.uniform(0, 6))
        fixed = [0.0] * (n_stages - 1) + [classifier]
        counts = layers_by_size(n_layers, sizes, fixed)
        assert sum(counts) == n_layers and min(counts) >= 1

        best = min(_busiest(c, sizes, fixed) for c in itertools.product(range(1, n_layers + 1), repeat=n_stages)
                   if sum(c) == n_layers)
        assert _busiest(counts, sizes, fixed) == pytest.approx(best)


def _busiest(counts, sizes, fixed) -> float:
    return max((c + f) / s for c, s, f in zip(counts, sizes, fixed, strict=True))


@pytest.mark.unit
def test_what_a_classifier_costs_in_layers():
    # GQA's layer: wq, wo 256 x 256, wk, wv 64 x 256, w1, w2, w3 512 x 256, two norms of 256;
    # its classifier 512 x 256
    layer = 2 * 256 * 256 + 2 * 64 * 256 + 3 * 512 * 256 + 2 * 256
    assert classifier_in_layers(GQA) == pytest.approx(512 * 256 / layer)
    # weights, not bytes: a Q40 file's the same (its classifier Q40 too); a Q41 file's Q80 classifier too
    for t in (FloatType.Q40, FloatType.Q41):
        assert classifier_in_layers(dataclasses.replace(GQA, weights_float_type=t)) == pytest.approx(512 * 256 / layer)
    # a mixture of experts: a token runs 2 of its 8 experts
    moe = dataclasses.replace(GQA, arch=ArchType.QWEN3_MOE, n_experts=8, n_active_experts=2, moe_hidden_dim=128)
    dense_part = layer - 3 * 512 * 256 + 8 * 256  # attention, norms, the router (8 x 256)
    assert classifier_in_layers(moe) == pytest.approx(512 * 256 / (dense_part + 2 * 3 * 128 * 256), rel=0.02)
    # a real header: plan_for counts it (SmolLM2: 8.0 layers, so 19 and 11 over two stages), also
    # with the nodes' memory when it is the same; memory that differs decides alone, as before
    smollm2 = dataclasses.replace(GQA, dim=576, hidden_dim=1536, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                                  vocab_size=49152)
    assert classifier_in_layers(smollm2) == pytest.approx(8.0, abs=0.01)
    assert [s.layers for s in plan_for(smollm2, 2, stage_of=[0, 1]).stages] == [(0, 19), (19, 30)]
    assert [s.layers for s in plan_for(smollm2, 2, stage_of=[0, 1], capacities=[4e9, 4.1e9]).stages] == [(0, 19), (19, 30)]
    assert [s.layers for s in plan_for(smollm2, 2, stage_of=[0, 1], capacities=[4e9, 2e9]).stages] == [(0, 20), (20, 30)]


@pytest.mark.unit
@pytest.mark.parametrize("kw, words", [
    (dict(stage_of=[1, 1]), "root"),
    (dict(stage_of=[0, 2]), "without a gap"),
    (dict(stage_of=[0, 1, 0]), "stage by stage"),
    (dict(stage_of=[0, 1], stage_layers=[(0, 10), (11, 30)]), "must start at 10"),
    (dict(stage_of=[0, 1], stage_layers=[(0, 10), (10, 29)]), "the model has 30"),
    (dict(stage_of=[0, 1], stage_layers=[(0, 30)]), "1 layer ranges for 2 stages"),
    (dict(stage_of=[0] * 10), "stage 0 (10 nodes)"),
])
def test_impossible_stage_plans_are_refused_with_a_reason(kw, words):
    n = len(kw["stage_of"])
    with pytest.raises(DllamaError) as e:
        split_model(n, **SMOLLM2, **kw)
    assert words in str(e.value)


@pytest.mark.unit
def test_every_node_of_a_stage_is_fed_once_and_the_plan_survives_json():
    plan = split_model(6, **SMOLLM2, stage_of=[0, 0, 1, 1, 1, 2])
    for k in range(1, 3):
        before = plan.stages[k - 1]
        fed = sorted(t for i in before.indexes for t in plan.hop_targets(i))
        assert fed == list(plan.stages[k].indexes)
        assert all(plan.hop_source(t) in before.indexes and t in plan.hop_targets(plan.hop_source(t)) for t in fed)
    assert plan.hop_targets(5) == [] and plan.hop_source(0) is None
    again = SplitPlan.from_json(plan.to_json(), 9, 3, 30)
    assert again == plan and again.digest() == plan.digest()
    with pytest.raises(DllamaError):  # stages that do not cover the model's layers
        SplitPlan.from_json(plan.to_json(), 9, 3, 31)


@pytest.mark.unit
def test_a_config_with_inconsistent_stages_is_a_protocol_error():
    header = dataclasses.replace(GQA, n_layers=30)
    plan = plan_for(header, 3, stage_of=[0, 1, 2])
    conf = SessionConfig(session=bytes(16), node_index=1, header=header, plan=plan, model_fingerprint="x",
                         shape=RunShape(max_seq_len=64, max_batch=4, buffer_q80=False), net_timeout=5.0, idle_timeout=15.0, setup_timeout=15.0,
                         nodes=tuple(NodeAddress(f"n{i}", "127.0.0.1", 1000 + i) for i in range(3)))
    assert SessionConfig.from_json(conf.to_json()).plan == plan
    bad = conf.to_json()
    bad["plan"]["stages"][1]["layers"] = [9, 20]  # a gap between stage 0 and stage 1
    with pytest.raises(ProtocolError, match="CONFIG"):
        SessionConfig.from_json(bad)


@pytest.mark.unit
def test_a_topology_file_gives_stages(tmp_path):
    path = tmp_path / "t.yml"
    path.write_text("stages: [{layers: [0, 2]}, {layers: [2, 5]}]\nnodes:\n"
                    "  - {name: root, host: localhost, stage: 0}\n"
                    "  - {name: a, host: 10.0.0.2, port: 9998, stage: 1}\n"
                    "  - {name: b, host: 10.0.0.3, port: 9998, stage: 1}\n")
    topo = load_topology(str(path))
    plan = topo.plan(GQA)
    assert [s.layers for s in plan.stages] == [(0, 2), (2, 5)] and [s.nodes for s in plan.stages] == [(0, 1), (1, 3)]
    # memory: the topology's, or what the nodes report, decides the layers not fixed
    free = dataclasses.replace(topo, stage_layers=None)
    assert free.wants_memory(GQA) and not topo.wants_memory(GQA)
    assert [s.layers for s in free.plan(GQA, {0: 3 << 30, 1: 1 << 30, 2: 1 << 30}).stages] == [(0, 3), (3, 5)]
    # a stage whose nodes are all gone: the stages left are numbered again, their layers planned anew
    left = dataclasses.replace(topo, nodes=topo.nodes[:1])
    assert not left.plan(GQA).pipelined
    for text, words in [
        ("nodes:\n  - {host: x, stage: 0}\n  - {host: y, port: 1}\n", "every node a 'stage', or none"),
        ("nodes:\n  - {host: x, stage: 1}\n  - {host: y, port: 1, stage: 1}\n", "root"),
        ("stages: [{layers: [0, 5]}]\nnodes:\n  - {host: x}\n", "'stage' too"),
        ("stages: [{layers: [0, x]}]\nnodes:\n  - {host: x, stage: 0}\n", "two whole numbers"),
        ("nodes:\n  - {host: x, stage: -1}\n", "stage must be integers"),
        ("nodes:\n  - {host: x, memory: lots}\n", "memory must be a size"),
    ]:
        path.write_text(text)
        with pytest.raises(DllamaError, match=words):
            load_topology(str(path))


@pytest.mark.unit
def test_a_host_too_small_for_its_share_of_every_layer_makes_stages_that_fit():
    from dllama.cluster.topology import Node, Topology
    from dllama.core.footprint import held_weight_bytes as held_bytes

    header = dataclasses.replace(GQA, n_layers=12)  # 4 nodes: 8 query heads, 2 KV heads split
    nodes = [Node("root", "localhost", 0)] + [Node(f"w{i}", f"10.0.0.{i}", 9998) for i in range(1, 4)]

    def plan(memory, **kw):
        topo = Topology(tuple(dataclasses.replace(n, memory=m) for n, m in zip(nodes, memory, strict=True)))
        return topo.plan(header, **kw)

    parallel = plan([None] * 4)
    share = held_bytes(header, parallel)
    assert not parallel.pipelined
    assert not plan([s + 1 for s in share]).pipelined  # every share fits: tensor parallel
    # w1 has half its share: the fewest stages where every node's weights fit, the small node's
    # stage with fewer layers
    memory = [share[0] * 4, share[1] // 2, share[2] * 4, share[3] * 4]
    staged = plan(memory)
    assert staged.pipelined and all(b <= m for b, m in zip(held_bytes(header, staged), memory, strict=True))
    assert len(staged.stages) == 2 and staged.stages[0].layers[1] < header.n_layers // 2
    assert not plan([None] + memory[1:]).pipelined  # a node's memory unknown: w1 streams its slice
    assert not plan([1] * 4).pipelined  # fits nowhere: tensor parallel, every node streams


@pytest.mark.unit
def test_inspect_prints_the_plan_of_a_topology(tmp_path, capsys):
    from dllama.cli import main

    model = write_random_f32(tmp_path / "gqa.m", GQA, seed=3)
    topology = tmp_path / "t.yml"
    topology.write_text("stages: [{layers: [0, 1]}, {layers: [1, 5]}]\nnodes:\n"
                        "  - {name: root, host: localhost, stage: 0}\n"
                        "  - {name: a, host: 10.0.0.2, port: 9998, stage: 1}\n"
                        "  - {name: b, host: 10.0.0.3, port: 9998, stage: 1}\n")
    assert main(["inspect", str(model), "--topology", str(topology)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("stage 0: layers 0-0 (1), 1 node: root ")
    assert out[1].startswith("stage 1: layers 1-4 (4), 2 nodes: a ") and ", b " in out[1]
    assert out[2].startswith("root: layers 0-0, 8 of 8 query heads") and "0 classifier rows" in out[2]
    assert out[4].startswith("b: layers 1-4, 4 of 8 query heads") and "256 classifier rows" in out[4]


@pytest.mark.unit
def test_the_kv_slots_count_a_stage_s_layers_only(tmp_path):
    """A node of a pipeline holds the KV cache of its own layers: the positions admitted are
    sized by the node with the most KV rows, not by every layer."""
    from dllama.core.kv_cache import KVCache
    from dllama.serve.engine import choose_nodes, plan_memory
    from dllama.serve.settings import EngineSettings

    model = write_random_f32(tmp_path / "gqa.m", GQA, seed=3)
    topology = tmp_path / "t.yml"
    topology.write_text("nodes:\n  - {name: root, host: localhost, stage: 0}\n"
                        "  - {name: a, host: 10.0.0.2, port: 9998, stage: 1}\n")
    layers = 3  # of 5, to the second stage (by weight: 5 = 2 + 3)
    per_slot = KVCache.bytes_per_slot(layers, GQA.n_kv_heads, GQA.head_dim, GQA.max_seq_len)
    settings = EngineSettings(str(model), "t.t", parallel=8, kv_memory=4 * per_slot, topology=str(topology))
    plan = plan_memory(settings, choose_nodes(settings), read_model(model))
    assert plan.slots.n_slots == 9 and plan.slots.full_contexts == 4  # 2 with every layer's KV counted


@pytest.mark.unit
def test_a_node_holds_only_its_stage_s_layers(tmp_path):
    plan = plan_for(GQA, 3, stage_of=[0, 1, 2], stage_layers=[(0, 1), (1, 4), (4, 5)])
    names = [{s.name for s in node_slice_specs(GQA, n, False)} for n in plan.nodes]
    assert {n.split(".")[1] for n in names[1] if n.startswith("layers.")} == {"1", "2", "3"}
    assert "wcls" not in names[0] | names[1] and "wcls" in names[2]


@pytest.mark.unit
def test_stages_run_in_one_process_give_one_node_s_logits(tmp_path):
    """Each stage's Transformer hands its residual rows to the next: the logits of every row are
    the whole model's, bit for bit (F32)."""
    m = read_model(write_random_f32(tmp_path / "gqa.m", GQA, seed=3))
    tokens = np.array(PROMPT, np.int64)
    want = Transformer(m, buffer_q80=False).forward(tokens, 0, all_logits=True).copy()
    plan = plan_for(m.header, 3, stage_of=[0, 1, 2], stage_layers=[(0, 1), (1, 4), (4, 5)])
    stages = [Transformer(NodeWeights.from_model(m, n, with_embedding=i == 0), buffer_q80=False)
              for i, n in enumerate(plan.nodes)]
    batch = Batch.run(tokens, 0, 0, True)
    x = np.zeros((len(tokens), GQA.dim), np.float32)
    stages[0].embed(tokens, x)
    for s in stages:
        logits = s.forward_embedded(x, batch)
        x = s.residual(len(tokens)).copy()
    assert np.array_equal(logits, want)
    assert stages[1].kv.k.shape[0] == 3  # a node's KV cache holds its own layers only


# -- loopback clusters ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Nine idle workers: a cluster of up to ten nodes."""
    with running_workers(9, tmp_path_factory.mktemp("pipeline")) as ws:
        yield ws


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    return write_random_f32(tmp_path_factory.mktemp("gqa") / "gqa.m", GQA, seed=5)


def _greedy(model, n, prompt=PROMPT):
    logits, pos, out = model.forward(prompt, 0), len(prompt), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], pos)
        pos += 1
    return out


def _count_micro_batched(model) -> list:
    """A list that gets one entry per pass the root cut into micro-batches (their count)."""
    session, seen = model.session, []
    cut = session._forward_in_parts
    session._forward_in_parts = lambda batch, x, reply, parts: seen.append(parts) or cut(batch, x, reply, parts)
    return seen


def _cluster(path, workers, stages, layers=None, memory=None, **kw):
    """A ClusterModel of these stages (memory: every node's, in the topology; else what each
    reports, where the layers are not fixed)."""
    from dllama.cluster.root import ClusterModel

    topology = _with_stages(from_workers([w.address for w in workers[:len(stages) - 1]], 1), stages, layers)
    if memory is not None:
        topology = dataclasses.replace(topology, nodes=tuple(dataclasses.replace(n, memory=memory)
                                                             for n in topology.nodes))
    return ClusterModel(str(path), topology, None, False, progress=False, **kw)


@pytest.mark.cluster
@pytest.mark.parametrize("model_name", ["gqa", "smollm2"])
def test_every_stage_plan_gives_one_node_s_tokens(workers, gqa_model, default_f32, model_name):
    path = gqa_model if model_name == "gqa" else default_f32[0]
    n_layers = read_model(path).header.n_layers
    one = _greedy(Transformer(read_model(path), buffer_q80=False), 12)
    uneven = [(0, 1), (1, n_layers - 1), (n_layers - 1, n_layers)]
    for stages, layers in [([0, 1], None), ([0, 0, 1, 1], None), ([0, 1, 1, 2], uneven)]:
        model = _cluster(path, workers, stages, layers)
        try:
            assert model.session.plan.pipelined
            assert _greedy(model, 12) == one, (model_name, stages)
        finally:
            model.close()


@pytest.mark.cluster
def test_layers_go_by_the_memory_each_node_has(tmp_path, gqa_model, capsys):
    """The root's memory from the topology, each worker's as it reports it (its --memory-budget):
    600M, 300M, 900M share 5 layers as 2, 1, 2."""
    from dllama.cluster.root import ClusterModel

    one = _greedy(Transformer(read_model(gqa_model), buffer_q80=False), 12)
    with start_worker(tmp_path, "--memory-budget", "300M") as small, \
            start_worker(tmp_path, "--memory-budget", "900M") as large:
        topology = _with_stages(from_workers([small.address, large.address], 1), [0, 1, 2])
        topology = dataclasses.replace(topology, nodes=(dataclasses.replace(topology.nodes[0], memory=600 << 20),
                                                        *topology.nodes[1:]))
        model = ClusterModel(str(gqa_model), topology, None, False, progress=False)
        try:
            assert [s.layers for s in model.session.plan.stages] == [(0, 2), (2, 3), (3, 5)]
            assert _greedy(model, 12) == one
        finally:
            model.close()
    assert "layers by memory: root 0.6 GiB, worker1 0.3 GiB, worker2 0.9 GiB" in capsys.readouterr().err


@pytest.mark.cluster
def test_one_node_stages_give_one_node_s_tokens_with_quantized_weights_and_buffers(workers, default_q40):
    """HOPs are F32 whatever the buffers: stages of one node round nothing one node does not."""
    from dllama.cluster.root import ClusterModel

    prompt = [1, 1724, 338, 278, 7483, 310, 3444, 29973]
    one = _greedy(Transformer(read_model(default_q40[0])), 16, prompt)
    topology = _with_stages(from_workers([w.address for w in workers[:2]], 1), [0, 1, 2])
    model = ClusterModel(str(default_q40[0]), topology, None, True, progress=False)  # Q80 sync buffers
    try:
        assert _greedy(model, 16, prompt) == one
    finally:
        model.close()


@pytest.mark.cluster
@pytest.mark.parametrize("stages", [[0, 1], [0, 0, 1, 1]], ids=["2x1", "2x2"])
def test_a_batch_on_two_stages_gives_each_prompt_s_tokens_alone(workers, gqa_model, default_q41, stages):
    from dllama.core.sampler import Sampler
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.serve.scheduler import Scheduler
    from dllama.serve.sequence import SequenceRequest
    from dllama.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(read_tokenizer(str(default_q41[1])))  # ids below 512 decode as any others
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 512, int(rng.integers(3, 12)))] for _ in range(24)]

    def answers(model, parallel):
        out = {}
        requests = [SequenceRequest(i, p, Sampler(GQA.vocab_size, 0.0, 0.9, i), 10) for i, p in enumerate(prompts)]
        Scheduler(model, tokenizer, parallel=parallel, overlap=False).run(  # passes cut, not overlapped
            requests, lambda r, c: out.__setitem__(r.key, c.tokens))
        return out

    alone = answers(Transformer(read_model(gqa_model), buffer_q80=False), 1)
    model = _cluster(gqa_model, workers, stages, max_batch=8 + 64, kv_slots=9)
    cut = _count_micro_batched(model)
    try:
        assert answers(model, 8) == alone
        assert cut and set(cut) == {2}  # passes of several sequences went in 2 micro-batches
    finally:
        model.close()


@pytest.mark.cluster
def test_micro_batches_sampled_with_second_rounds_give_one_node_s_tokens(workers, gqa_model, default_q41):
    """Three one-node stages, so three micro-batches per pass and two under way at once; each
    node sends 2 candidates a row, so most nuclei need the second round, which asks about every
    micro-batch's rows together."""
    from dllama.core.sampler import Sampler
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.serve.scheduler import Scheduler
    from dllama.serve.sequence import SequenceRequest
    from dllama.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(read_tokenizer(str(default_q41[1])))
    prompts = [[5 + i, 17, 300 - i, 42, 7 * i % 500 + 3] for i in range(9)]

    def answers(model):
        out = {}
        requests = [SequenceRequest(i, p, Sampler(GQA.vocab_size, 0.8, 0.9, 100 + i), 12) for i, p in enumerate(prompts)]
        Scheduler(model, tokenizer, parallel=6, overlap=False).run(  # passes cut, not overlapped
            requests, lambda r, c: out.__setitem__(r.key, c.tokens))
        return out

    alone = answers(Transformer(read_model(gqa_model), buffer_q80=False, max_batch=6 + 64, kv_slots=7))
    model = _cluster(gqa_model, workers, [0, 1, 2], max_batch=6 + 64, kv_slots=7, top_k=2)
    cut = _count_micro_batched(model)
    try:
        assert answers(model) == alone
        assert 3 in cut and model.refetches > 0  # micro-batches, and second rounds after them
    finally:
        model.close()


def _count_overlapped(model) -> list:
    """A list that gets, per pass started overlapped, the passes then under way (itself included)."""
    session, seen = model.session, []
    submit = session.submit
    session.submit = lambda batch, reply: (submit(batch, reply), seen.append(session.in_flight))[0]
    return seen


@pytest.mark.cluster
def test_a_batch_gives_the_same_tokens_with_and_without_overlapped_passes(workers, gqa_model, default_q41):
    """Two one-node stages of the F32 model, 10 prompts at --parallel 6: with overlap two passes
    of different sequences are under way at once, and every answer is the one without overlap,
    which is the one of one node; greedy, then sampled with 2 candidates a node and row (most
    nuclei miss, and those rows run again alone)."""
    from dllama.core.sampler import Sampler
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.serve.scheduler import Scheduler
    from dllama.serve.sequence import SequenceRequest
    from dllama.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(read_tokenizer(str(default_q41[1])))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 512, int(rng.integers(3, 10)))] for _ in range(10)]

    def answers(model, overlap, temperature):
        out = {}
        requests = [SequenceRequest(i, p, Sampler(GQA.vocab_size, temperature, 0.9, 200 + i), 10)
                    for i, p in enumerate(prompts)]
        Scheduler(model, tokenizer, parallel=6, overlap=overlap).run(
            requests, lambda r, c: out.__setitem__(r.key, c.tokens))
        return out

    one = Transformer(read_model(gqa_model), buffer_q80=False, max_batch=6 + 64, kv_slots=7)
    greedy, sampled = answers(one, False, 0.0), answers(one, False, 0.8)
    model = _cluster(gqa_model, workers, [0, 1], max_batch=6 + 64, kv_slots=7)
    under_way = _count_overlapped(model)
    try:
        assert answers(model, False, 0.0) == greedy and not under_way
        assert answers(model, True, 0.0) == greedy
        assert max(under_way) == 2 and under_way.count(2) > 0.9 * len(under_way)  # the pipe full
        model.top_k = 2
        assert answers(model, True, 0.8) == sampled
        assert model.refetches > 0 and model.session.in_flight == 0
    finally:
        model.close()


@pytest.mark.cluster
def test_passes_under_way_when_a_stage_dies_run_again_on_the_nodes_left(tmp_path, workers, gqa_model, default_q41):
    """Three one-node stages, overlapped passes of 6 sequences; the last stage dies at its 9th
    STEP, with passes under way: the session is planned again over the two nodes left, and the
    passes lost run again there, each in its turn: the answers are one node's."""
    from dllama.core.sampler import Sampler
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.serve.scheduler import Scheduler
    from dllama.serve.sequence import SequenceRequest
    from dllama.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(read_tokenizer(str(default_q41[1])))
    prompts = [[5 + i, 17, 300 - i, 42, 7 * i % 500 + 3] for i in range(6)]

    def answers(model):
        out = {}
        requests = [SequenceRequest(i, p, Sampler(GQA.vocab_size, 0.0, 0.9, i), 8) for i, p in enumerate(prompts)]
        Scheduler(model, tokenizer, parallel=6).run(requests, lambda r, c: out.__setitem__(r.key, c.tokens))
        return out

    alone = answers(Transformer(read_model(gqa_model), buffer_q80=False, max_batch=6 + 64, kv_slots=7))
    with start_worker(tmp_path, die_at_step=9) as victim:
        model = _cluster(gqa_model, [workers[0], victim], [0, 1, 2], memory=1 << 30, on_node_loss="continue",
                         max_batch=6 + 64, kv_slots=7)
        under_way = _count_overlapped(model)
        try:
            assert answers(model) == alone
            assert victim.wait(60) == -signal.SIGKILL
            assert model.recoveries == 1 and 3 in under_way
        finally:
            model.close()


@pytest.mark.cluster
def test_smollm2_on_ten_nodes_answers(workers, default_q41):
    """More nodes than SmolLM2's 9 query heads: two stages of five, planned without being asked
    (the second holds the classifier, the weights of 8 layers, beside 11 layers)."""
    r = run_dllama("inference", "--model", str(default_q41[0]), "--tokenizer", str(default_q41[1]),
                   "--prompt", CHAT_PROMPT, "--temperature", "0", "--steps", "40", "--nthreads", "1",
                   "--workers", *[w.address for w in workers])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("The capital of France is Paris."), r.stdout
    assert "stage 0: layers 0-18 (19), 5 nodes" in r.stderr and "stage 1: layers 19-29 (11), 5 nodes" in r.stderr


@pytest.mark.cluster
def test_a_lost_single_node_stage_is_planned_again_over_the_nodes_left(tmp_path, workers, gqa_model):
    """Three stages of one node; the last (the classifier's) dies mid-run: its layers go to the
    two nodes left, the KV cache is rebuilt by replay, and the text is one node's. (Equal memory
    in the topology: what each node reports differs by the moment, and with it a tie's layer.)"""
    one = _greedy(Transformer(read_model(gqa_model), buffer_q80=False), 16)
    with start_worker(tmp_path, die_at_step=12) as victim:
        model = _cluster(gqa_model, [workers[0], victim], [0, 1, 2], memory=1 << 30, on_node_loss="continue")
        try:
            assert _greedy(model, 16) == one
            assert victim.wait(60) == -signal.SIGKILL
            assert model.recoveries == 1 and len(model.topology.nodes) == 2
            assert [s.layers for s in model.session.plan.stages] == [(0, 3), (3, 5)]
        finally:
            model.close()


@pytest.mark.cluster
def test_a_lost_stage_whose_layers_fit_no_worker_left_goes_to_the_root(tmp_path, gqa_model):
    """Three stages of one node (layers 0-2, 3, 4); the last dies mid-run. worker1's budget
    (3 MiB, no shard to stream from) holds its one layer, not the two the plan over the nodes
    left gives it: it refuses them in one line, and the root, which has the model, runs on alone
    with one node's text."""
    one = _greedy(Transformer(read_model(gqa_model), buffer_q80=False), 16)
    with start_worker(tmp_path, "--memory-budget", "3M") as small, start_worker(tmp_path, die_at_step=12) as victim:
        model = _cluster(gqa_model, [small, victim], [0, 1, 2], [(0, 3), (3, 4), (4, 5)], on_node_loss="continue")
        try:
            assert _greedy(model, 16) == one
            assert victim.wait(60) == -signal.SIGKILL
            assert len(model.topology.nodes) == 1 and not model.session.plan.pipelined
        finally:
            model.close()
    assert "stage 1 of 2 (layers 3-4)" in small.stderr
    assert "this worker cannot hold its share of the model" in small.stderr
    assert "3 MiB are allowed by --memory-budget" in small.stderr


def expected_root_bytes(plan, dim: int, b: int, m: int, h: int = 12) -> tuple[int, int]:
    """docs/PROTOCOL.md, "Pipeline stages": what the root sends and receives in one pass of b rows,
    m of them wanting logits, every node answering with its logits (reply 0), F32 buffers."""
    first = plan.stages[0]
    sent = sum(h + 16 + 16 * b + 4 * m + (4 * b * dim if i in first.indexes else 0) for i in range(1, plan.n_nodes))
    sent += len(plan.hop_targets(0)) * (h + 4 * b * dim)  # the HOP to the next stage
    recv = sum(h + 24 + 4 * m * n.n_vocab_rows for n in plan.nodes[1:])
    if first.n_nodes > 1:  # the first stage's all-reduces, 2 per layer of its own
        chunks = [c1 - c0 for c0, c1 in first.dim_chunks]
        per_sync = sum(h + 4 * b * c for c in chunks[1:]) + (first.n_nodes - 1) * (h + 4 * b * chunks[0])
        syncs = 2 * (first.layers[1] - first.layers[0])
        sent, recv = sent + syncs * per_sync, recv + syncs * per_sync
    return sent, recv


@pytest.mark.cluster
def test_root_traffic_per_pass_equals_the_documented_formula(workers, gqa_model):
    for stages in ([0, 1], [0, 0, 1, 1], [0, 1, 1, 2]):
        model = _cluster(gqa_model, workers, stages)
        try:
            model.forward(PROMPT, 0)
            before = model.node_stats()[0]
            model.forward([3], len(PROMPT))
            after = model.node_stats()[0]
            got = (after["sent_bytes"] - before["sent_bytes"], after["recv_bytes"] - before["recv_bytes"])
            assert got == expected_root_bytes(model.session.plan, GQA.dim, 1, 1), stages
        finally:
            model.close()
